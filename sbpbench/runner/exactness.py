"""`sbp check`: does each method give standard BP's loss and gradients on this model, here?

Builds the spec's model (random weights, seeded) in fp64 or fp32, one synthetic batch with the
paper's random right padding, and compares every method with `bp` (see methods/exactness.py):
in fp64 directly (1e-10); in fp32 against a float64 step on the same weights, each method within a
small factor of bp's own fp32 error (`judge_against_fp64`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..config import RunSpec
from ..methods import METHODS, MethodSettings
from ..methods.exactness import (
    FLOAT32_COMPUTE_NOTE,
    TOLERANCE,
    MethodComparison,
    compare_methods,
    compare_step,
    judge_against_fp64,
    step_gradients,
)
from ..workload.build import build_model_and_batch


@dataclass(frozen=True)
class ExactnessSpec:
    """One spec per method, all of one model and batch: the first is the reference (bp), the
    rest are compared with it, each with the settings it reads. With LoRA the adapters get
    seeded non-zero B matrices (gradients everywhere)."""

    specs: tuple[RunSpec, ...]

    @property
    def reference(self) -> RunSpec:
        return self.specs[0]


def check_exactness(spec: ExactnessSpec) -> list[MethodComparison]:
    run = spec.reference
    # LoRA B matrices start at zero, which would make every A gradient zero: seeded non-zero B
    model, batch = build_model_and_batch(run, lora_alpha=2 * run.lora_rank, lora_init_seed=run.seed)
    # each method reads its own knobs from one settings object: the union of what the specs set
    settings = MethodSettings(
        **{
            name: next((v for s in spec.specs if (v := getattr(s.settings, name)) is not None), None)
            for name in (f.name for f in fields(MethodSettings))
        }
    )
    methods = [s.method for s in spec.specs[1:]]
    if run.dtype == "fp32":
        results = judge_against_fp64(model, batch, methods, settings, baseline=run.method)
    else:
        results = compare_methods(model, batch, methods, settings, reference=run.method)
    external = {s.method: s for s in spec.specs[1:] if METHODS[s.method].external}
    if external:  # official: the same weights and batch through its own environment
        from .official import official_gradients

        reference = step_gradients(run.method, model, batch, settings)
        for i, result in enumerate(results):
            if result.method in external:
                try:
                    ours = official_gradients(external[result.method], model)
                except RuntimeError as error:
                    results[i] = MethodComparison(result.method, run.method, None, [], unsupported=str(error))
                    continue
                results[i] = compare_step(result.method, run.method, model, ours, reference)
    return results


def float32_note(run: RunSpec, results) -> str:
    """fp64: why some tensors were judged at float32's 1e-5 (modules that compute in float32,
    methods/exactness.py), and how close every other tensor came to its 1e-10; "" otherwise."""
    tight = TOLERANCE[run.torch_dtype] if run.dtype == "fp64" else None
    grads = [d for r in results for d in r.grads if d.tolerance is not None]
    loose = sorted((d for d in grads if tight is not None and d.tolerance > tight), key=lambda d: -d.rel_error)
    if not loose:
        return ""
    largest = max((d.rel_error for d in grads if d.tolerance == tight), default=0.0)
    return (
        f"fp64: {len({d.name for d in loose})} tensor(s) judged at 1e-05, such as {loose[0].name}: "
        f"{FLOAT32_COMPUTE_NOTE}. Every other "
        f"gradient is judged at {tight:g}: its largest error here is {largest:.1e}."
    )
