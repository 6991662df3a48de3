"""`sbp check`: does each method give standard BP's loss and gradients on this model, here?

Builds the spec's model (random weights, seeded) in fp64, fp32 or bf16, one synthetic batch with
the paper's random right padding, and compares every method with `bp` (see methods/exactness.py):
in fp64 directly (1e-10); in fp32 against a float64 step on the same weights, each method within a
small factor of bp's own fp32 error (`judge_against_fp64`); in bf16 likewise, within a few times
bp's own bf16 error (`judge_low_precision`). With --nproc over 1 the compared methods run on ranks
(runner/rank_gradients.py) and the same rules judge them against bp's steps in this process. With
an `out` file, each comparison is appended to it as an ExactnessRow (records/exactness.py).
StreamBP's chunk attention runs the lower-right reference unless a kernel is named: a check never
reads the table of measured kernels a timed run may use (runner/kernel_table.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime
from pathlib import Path

from ..config import RunSpec
from ..core.internal import AUTO, LOWER_RIGHT
from ..measure.environment import Environment, capture_environment
from ..methods import METHODS, MethodSettings
from ..methods.exactness import (
    FLOAT32_COMPUTE_NOTE,
    TOLERANCE,
    MethodComparison,
    StepOf,
    compare_methods,
    compare_step,
    judge_against_fp64,
    judge_low_precision,
    step_gradients,
)
from ..records.exactness import ExactnessRow, check_exactness_writable, write_exactness
from ..records.store import RowsNotSaved
from ..workload.build import build_model_and_batch

LOW_PRECISION = ("bf16",)  # judged against an fp64 step by bp's own error (judge_low_precision)
EXTERNAL_NOTE = "ran in its own virtualenv (runner/official.py: streambp 1.0, transformers 4.51.3)"


@dataclass(frozen=True)
class ExactnessSpec:
    """One spec per method, all of one model and batch: the first is the reference (bp), the
    rest are compared with it, each with the settings it reads. With LoRA the adapters get
    seeded non-zero B matrices (gradients everywhere). `out`: a CSV the comparisons are appended to."""

    specs: tuple[RunSpec, ...]
    out: Path | None = None

    @property
    def reference(self) -> RunSpec:
        return self.specs[0]


@dataclass(frozen=True)
class ExactnessCheck:
    """What `check_exactness` found: a comparison per spec, in spec order (fp32: the first is bp's
    own step against fp64); the number of rows appended to the spec's `out`, or why they were not
    (the error names the file beside it that keeps them)."""

    results: list[MethodComparison]
    appended: int = 0
    not_saved: RowsNotSaved | None = None


def check_exactness(spec: ExactnessSpec) -> ExactnessCheck:
    """Compare each method with the reference; append the comparisons to `spec.out` if given (its
    header checked before anything runs)."""
    if spec.out is not None:
        check_exactness_writable(spec.out)
    spec = pinned_kernels(spec)
    results = compare_all(spec)
    if spec.out is None:
        return ExactnessCheck(results)
    rows = exactness_rows(list(spec.specs), results)
    try:
        write_exactness(spec.out, rows)
    except RowsNotSaved as error:
        return ExactnessCheck(results, not_saved=error)
    return ExactnessCheck(results, appended=len(rows))


def pinned_kernels(spec: ExactnessSpec) -> ExactnessSpec:
    """The specs with StreamBP's chunk kernel auto written as what it runs here, the lower-right
    reference: a check judges one fixed kernel in every dtype, and its rows say which. A kernel
    named (`--set chunk_attention=split`) is checked as named."""
    specs = tuple(
        replace(s, settings=replace(s.settings, chunk_attention=LOWER_RIGHT))
        if s.settings.chunk_attention == AUTO
        else s
        for s in spec.specs
    )
    return replace(spec, specs=specs)


def compare_all(spec: ExactnessSpec) -> list[MethodComparison]:
    """A comparison per spec, in spec order (module docstring)."""
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
    ranked = any(s.nproc > 1 for s in spec.specs[1:])  # the compared methods on ranks, bp here
    if ranked and run.dtype == "fp64":
        return ranked_comparisons(spec, model, batch, settings)
    steps = ranked_steps(spec) if ranked else None  # else each method's step on this model
    if run.dtype == "fp32":
        results = judge_against_fp64(model, batch, methods, settings, baseline=run.method, steps=steps)
    elif run.dtype in LOW_PRECISION:
        results = judge_low_precision(model, batch, methods, settings, baseline=run.method, steps=steps)
    else:
        results = compare_methods(model, batch, methods, settings, reference=run.method)
    external = {s.method: s for s in spec.specs[1:] if METHODS[s.method].external}
    if external and not ranked:  # official: the same weights and batch through its own environment
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


def ranked_comparisons(spec: ExactnessSpec, model, batch, settings: MethodSettings) -> list[MethodComparison]:
    """fp64: each compared method on its spec's ranks (runner/rank_gradients.py: FSDP2, --sp ranks
    sharing each sequence, every data rank on this batch) against the reference's step in this process."""
    from .rank_gradients import RankedStepUnsupported, ranked_step

    run = spec.reference
    reference = step_gradients(run.method, model, batch, settings)
    results = []
    for ranked in spec.specs[1:]:
        try:
            ours = ranked_step(ranked)
        except RankedStepUnsupported as error:
            results.append(MethodComparison(ranked.method, run.method, None, [], unsupported=str(error)))
            continue
        results.append(compare_step(ranked.method, run.method, model, ours, reference))
    return results


def ranked_steps(spec: ExactnessSpec) -> StepOf:
    """Each compared method's step on its spec's ranks (as ranked_comparisons runs it), by name, for
    the fp32 and bf16 judges: they hold the fp64 reference and bp's own step, run in this process on
    the same seeded weights (the ranks build them alike). A method that cannot run there is
    MethodUnsupported (RankedStepUnsupported), reported as in one process."""
    from .rank_gradients import ranked_step

    by_method = {s.method: s for s in spec.specs[1:]}
    return lambda method: ranked_step(by_method[method])


def ranks_note(spec: RunSpec) -> str:
    """How a compared method ran when on several ranks ("" in one process)."""
    if spec.nproc == 1:
        return ""
    shared = f", {spec.sp} sharing each sequence (Ulysses)" if spec.sp > 1 else ""
    return f"on {spec.nproc} ranks (FSDP2{shared}), every data rank on this batch"


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


def exactness_rows(specs: list[RunSpec], results: list[MethodComparison]) -> list[ExactnessRow]:
    """The rows of a check (results: in spec order): one per compared method; fp32 and bf16 leave
    out bp's own step against fp64, the first."""
    by_method = {spec.method: spec for spec in specs}
    compared = results[1:] if specs[0].dtype in ("fp32", *LOW_PRECISION) else results
    env = capture_environment(specs[0].device)
    return [exactness_row(by_method[r.method], r, env) for r in compared]


def exactness_row(spec: RunSpec, result: MethodComparison, env: Environment) -> ExactnessRow:
    """One comparison as a row of the exactness CSV, with the point, settings and provenance."""
    worst = result.worst
    settings = " ".join(f"{k}={v}" for k, v in spec.settings.as_dict().items() if v is not None)
    if result.loss is None:
        outcome = "unsupported"
    else:
        outcome = "exact" if result.ok else "differs"
    return ExactnessRow(
        timestamp_utc=datetime.now(UTC).isoformat(timespec="seconds"),
        method=result.method,
        reference=result.reference,
        result=outcome,
        loss_rel_error=None if result.loss is None else result.loss.rel_error,
        grad_rel_error=None if worst is None else worst.rel_error,
        worst_tensor="" if worst is None else worst.name,
        tolerance=None if worst is None else worst.tolerance,
        note=result.unsupported or (EXTERNAL_NOTE if METHODS[result.method].external else ranks_note(spec)),
        model=spec.model,
        num_layers=spec.num_layers,
        objective=spec.objective,
        lora_rank=spec.lora_rank,
        dtype=spec.dtype,
        batch_size=spec.batch_size,
        seq_len=spec.seq_len,
        settings=settings,
        device=spec.device,
        torch_version=env.torch_version,
        transformers_version=env.transformers_version,
        git_commit=env.git_commit,
        git_dirty=env.git_dirty,
    )
