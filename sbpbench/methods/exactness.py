"""Numerical identity of methods: loss and every parameter gradient against a reference method.

The error of a tensor is max|ours - ref| / max|ref| (infinity norms), so a tensor of tiny entries
beside large ones cannot hide a wrong sign. Tolerances are the project's invariants (docs/exactness.md):
fp64 1e-10, fp32 1e-5; bf16 against a float64 step, within a few times BP's own bf16 error (`judge_low_precision`).

fp32 at scale (`judge_against_fp64`): a fixed 1e-5 between two fp32 methods fails on rounding
alone once sums run over thousands of positions (a small q_norm-like gradient on an H100 at T=9000:
5.98458e-4 vs 5.98452e-4). So, as the paper's Table 6 and tests/exactness/test_bf16.py do, every method runs
in fp32 and is compared with a float64 step on the same weights; a method passes a tensor when
its error is within FP32_ERROR_FACTOR x standard BP's own fp32 error on that tensor (plus a
relative floor of a few units of fp32 rounding, and the absolute noise floor below). A wrong
gradient is off by far more than BP's rounding (tests/exactness/test_exactness_fp32.py perturbs one). The
loss is judged the same way: a DPO loss is a difference of sums over thousands of log-probs, so
fp32 cancellation leaves BP's own loss 1.9e-4 off the float64 one (Qwen3-0.6B, T=4096, one H100).
The judging is a pure function of the three steps (`judge_baseline`, `judge_fp32_step`), so it is
tested on a CPU with stand-in steps.

A gradient that is zero in exact arithmetic (a query gradient when every query sees one key, as
at T = 2) comes out of both methods as rounding noise, where a relative error means nothing. So a
difference also passes when it is within ROUNDING_UNITS units of rounding (machine epsilon) of
the model's largest reference gradient: noise of the model's own scale, never a wrong result.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.internal import Float64Throughout
from ..data import SFTBatch
from .registry import run_method
from .settings import MethodSettings
from .unsupported import MethodUnsupported

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
ROUNDING_UNITS = 4

# judge_against_fp64: a method's fp32 error on a tensor may be this many times BP's own. Per-tensor
# max-element errors of two correct fp32 methods differ by chance (different summation orders), so
# the factor leaves room (streambp over bp, per tensor: at most 1.15x on the Qwen3-4B shape at T=256,
# 1.45x on tiny/qwen3; benchmarks/fp32_vs_fp64_cpu_2026-11-23.md), while a wrong gradient (off by far more than
# rounding) still fails (tests/exactness/test_exactness_fp32.py).
FP32_ERROR_FACTOR = 4.0
# Relative floor on every tensor's bound: BP may round a tensor (nearly) exactly where another
# summation order cannot; 64 fp32 units (7.6e-6) is below the old fixed 1e-5.
FP32_RELATIVE_FLOOR = 64 * torch.finfo(torch.float32).eps
# The float64 reference must deserve the name: BP's own fp32 step is within this of it on every
# tensor (or within the noise floor), and on the loss. Catches a wrong reference (say, a method
# computed in fp64 on a device where it is broken) that would otherwise make every method look as
# good as BP. fp32 rounding stays far below it: 1.9e-4 on the DPO loss above is the largest seen.
BASELINE_SANITY = 1e-3

# What `sbp check` says when an fp64 check judged some tensors at float32's tolerance (docs/exactness.md):
# a module that casts float64 values to float32 (an RMSNorm that upcasts, as Gemma's does, a float32
# router) makes float32 reductions of its weight gradients, summed per chunk by StreamBP and over
# the whole sequence by standard BP: equal to float32 rounding only. Found by watching a forward.
FLOAT32_COMPUTE_NOTE = (
    "their modules compute in float32 inside a float64 model (found in a forward), so the gradients of their weights "
    "agree to float32 rounding only"
)


@dataclass(frozen=True)
class TensorDiff:
    name: str
    rel_error: float
    max_abs_diff: float
    index: tuple  # where the largest difference is
    ours: float
    reference: float
    tolerance: float | None  # on rel_error; None: reported, not judged
    noise_floor: float = 0.0  # absolute difference that is rounding noise whatever the tensor's scale

    @property
    def ok(self) -> bool:
        if math.isnan(self.rel_error):
            return False
        return self.tolerance is None or self.rel_error <= self.tolerance or self.max_abs_diff <= self.noise_floor

    def describe(self) -> str:
        return (
            f"{self.name}: rel error {self.rel_error:.3e} (tolerance {self.tolerance}), max |diff| "
            f"{self.max_abs_diff:.3e} (rounding floor {self.noise_floor:.1e}) at {self.index}: "
            f"{self.ours!r} vs reference {self.reference!r}"
        )


def tensor_diff(
    name: str, ours: torch.Tensor, reference: torch.Tensor, tolerance: float | None, noise_floor: float = 0.0
) -> TensorDiff:
    """Compared in float64 where the tensors are (one float64 temporary the size of the tensor: a
    Qwen3 embedding gradient is 389M elements)."""
    ours, reference = ours.detach(), reference.detach()
    if ours.shape != reference.shape:
        return TensorDiff(name, float("inf"), float("inf"), (), float("nan"), float("nan"), tolerance)
    if ours.numel() == 0:
        return TensorDiff(name, 0.0, 0.0, (), 0.0, 0.0, tolerance)
    diff = ours.to(torch.float64, copy=True)
    diff.sub_(reference.to(diff.device)).abs_()
    has_nan = bool(diff.isnan().any())  # a NaN is the worst difference
    flat = int(diff.view(-1).nan_to_num_(nan=float("inf")).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    max_diff = float("nan") if has_nan else float(diff.view(-1)[flat])
    del diff
    scale = float(torch.linalg.vector_norm(reference, ord=float("inf")))  # max |reference|, no temporary
    rel = max_diff / scale if scale > 0 else max_diff  # NaN propagates and fails every tolerance
    return TensorDiff(name, rel, max_diff, index, float(ours[index]), float(reference[index]), tolerance, noise_floor)


@dataclass(frozen=True)
class MethodComparison:
    method: str
    reference: str
    loss: TensorDiff | None  # None: the method cannot run here (unsupported says why)
    grads: list[TensorDiff]
    # judge_against_fp64 only: the worst per-tensor error against the baseline's fp32 gradients
    # (the old fixed-tolerance rule's number), for reports
    versus_baseline: float | None = None
    unsupported: str = ""

    @property
    def worst(self) -> TensorDiff | None:
        """The failing tensor, else the one nearest its tolerance (the largest error if unjudged);
        None for a method that did not run."""
        return max(
            self.grads,
            key=lambda d: (not d.ok, d.rel_error / d.tolerance if d.tolerance else d.rel_error),
            default=None,
        )

    @property
    def ok(self) -> bool:
        """Exact, or not run here: an unsupported method is reported, not a failure."""
        return self.loss is None or (self.loss.ok and all(d.ok for d in self.grads))

    def failures(self) -> list[TensorDiff]:
        return [] if self.loss is None else [d for d in [self.loss, *self.grads] if not d.ok]


def step_gradients(method, model, batch: SFTBatch, settings: MethodSettings, *, throughout: bool = False):
    """Run one step from zero gradients; return (loss, {parameter name: grad or zeros}).
    throughout: a float64 model's float32 computations (an attention softmax, a norm's upcast) run
    in float64 (Float64Throughout), as they do for every method compared in this process."""
    model.zero_grad(set_to_none=True)
    with float64_throughout(model) if throughout else contextlib.nullcontext():
        loss = run_method(method, model, batch, settings)
    grads = {  # taken from the model, not copied (a copy would double the memory of a large model)
        name: (p.grad.detach() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    model.zero_grad(set_to_none=True)
    return loss, grads


def float64_throughout(model):
    """Float64Throughout for a model whose every parameter is float64, else nothing. Methods that
    all run so compare their math in float64, not float32 rounding that differs by summation order."""
    if all(p.dtype == torch.float64 for p in model.parameters()):
        return Float64Throughout()
    return contextlib.nullcontext()


def _judging_dtypes(model) -> dict[str, torch.dtype]:
    """Per parameter, the precision its gradient is judged in: the model's, or float32 for the
    parameters of modules that compute in float32 inside a float64 model."""
    dtypes = {name: model.dtype for name, _ in model.named_parameters()}
    if model.dtype == torch.float64:
        for module_name in float32_compute_modules(model):
            for param_name, _ in model.get_submodule(module_name).named_parameters(recurse=False):
                dtypes[f"{module_name}.{param_name}" if module_name else param_name] = torch.float32
    return dtypes


class _Float32Casts(TorchDispatchMode):
    """Records the running module when one of its own float64 parameters is cast to float32."""

    def __init__(self, running: list[tuple[str, set[int]]]):
        super().__init__()
        self.running, self.found = running, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.float32 and self.running:
            name, own = self.running[-1]
            if isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64 and id(args[0]) in own:
                self.found.add(name)
        return func(*args, **kwargs)


def float32_compute_modules(model) -> set[str]:
    """The modules that cast their own float64 weights to float32 in a forward of this float64
    model (two positions): an RMSNorm that multiplies in float32, as Gemma's does. Their weight
    gradients are float32 sums over positions, summed per chunk by StreamBP."""
    running: list[tuple[str, set[int]]] = []
    handles = []
    for name, module in model.named_modules():
        own = {id(p) for p in module.parameters(recurse=False)}
        if own:
            hook = lambda m, a, n=name, own=own: running.append((n, own)) and None
            handles.append(module.register_forward_pre_hook(hook))
            handles.append(module.register_forward_hook(lambda m, a, o: running.pop() and None, always_call=True))
    ids = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
    try:
        with torch.no_grad(), _Float32Casts(running) as mode:
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return mode.found


def _grad_diffs(grads: dict, ref_grads: dict, dtypes: dict) -> list[TensorDiff]:
    """dtypes: the precision each parameter is judged in (missing: its own)."""
    scale = max((float(g.abs().max()) for g in ref_grads.values() if g.numel()), default=0.0)
    diffs = []
    for name, ref in ref_grads.items():
        dtype = dtypes.get(name, ref.dtype)
        floor = ROUNDING_UNITS * torch.finfo(dtype).eps * scale if dtype in TOLERANCE else 0.0
        diffs.append(tensor_diff(name, grads[name], ref, TOLERANCE.get(dtype), floor))
    return diffs


def compare_methods(
    model, batch: SFTBatch, methods: list[str], settings: MethodSettings, reference: str = "bp"
) -> list[MethodComparison]:
    """Run the reference and each method on the same model and batch and compare; in float64 every
    step runs with the model's float32 computations in float64, and every tensor is judged at 1e-10.
    With FlexAttention forced they stay float32 and are judged at float32's tolerance: torch compiles
    FlexAttention's op even in eager mode, and a compile runs under no dispatch mode."""
    throughout = settings.chunk_attention != "flex"
    ref_loss, ref_grads = step_gradients(reference, model, batch, settings, throughout=throughout)
    results = []
    for method in methods:
        try:
            loss, grads = step_gradients(method, model, batch, settings, throughout=throughout)
        except MethodUnsupported as error:
            model.zero_grad(set_to_none=True)
            results.append(MethodComparison(method, reference, None, [], unsupported=str(error)))
            continue
        ours, ref = (loss, grads), (ref_loss, ref_grads)
        results.append(compare_step(method, reference, model, ours, ref, float32_modules=not throughout))
    return results


def _same_precision_diffs(grads: dict, ref_grads: dict) -> float:
    return max((tensor_diff(n, grads[n], r, None).rel_error for n, r in ref_grads.items()), default=0.0)


Step = tuple  # (loss, {parameter name: gradient}) of one step, as step_gradients returns it
StepOf = Callable[[str], Step]  # a method's step by name, on the judged model's weights


def _steps_on(model, batch: SFTBatch, settings: MethodSettings) -> StepOf:
    """Each method's step in this process, on `model` as it is now."""
    return lambda method: step_gradients(method, model, batch, settings)


def judge_baseline(baseline: str, reference: str, ours: Step, ref: Step) -> MethodComparison:
    """The baseline's fp32 step against the float64 reference step: its loss and every gradient
    within BASELINE_SANITY (a gradient also within the noise floor of ROUNDING_UNITS fp32 units of
    the largest reference gradient). It answers "is the reference a reference?", and its errors
    are what judge_fp32_step allows a method a multiple of."""
    (loss, grads), (ref_loss, ref_grads) = ours, ref
    scale = max(
        (float(torch.linalg.vector_norm(g, ord=float("inf"))) for g in ref_grads.values() if g.numel()), default=0.0
    )
    floor = ROUNDING_UNITS * torch.finfo(torch.float32).eps * scale
    diffs = [tensor_diff(n, grads[n], r, BASELINE_SANITY, floor) for n, r in ref_grads.items()]
    return MethodComparison(baseline, reference, tensor_diff("loss", loss, ref_loss, BASELINE_SANITY), diffs)


def _bound(baseline_error: float) -> float:
    return FP32_ERROR_FACTOR * baseline_error + FP32_RELATIVE_FLOOR


def judge_fp32_step(
    method: str, ours: Step, baseline: MethodComparison, ref: Step, base_grads=None
) -> MethodComparison:
    """A method's fp32 step against the float64 reference step: its loss and each gradient within
    FP32_ERROR_FACTOR x the baseline's own error on it plus FP32_RELATIVE_FLOOR (a gradient also
    within the baseline's noise floor). `baseline` is judge_baseline's result; with the baseline's
    gradients, versus_baseline reports the old fixed rule's number."""
    (loss, grads), (ref_loss, ref_grads) = ours, ref
    base = {d.name: d for d in baseline.grads}
    diffs = [tensor_diff(n, grads[n], r, _bound(base[n].rel_error), base[n].noise_floor) for n, r in ref_grads.items()]
    loss_diff = tensor_diff("loss", loss, ref_loss, _bound(baseline.loss.rel_error))
    versus = None if base_grads is None else _same_precision_diffs(grads, base_grads)
    return MethodComparison(method, baseline.reference, loss_diff, diffs, versus)


def fp64_step(method: str, model, batch: SFTBatch, settings: MethodSettings) -> Step:
    """One step of `method` on the fp32 model's weights upcast to float64 (exact); the model is
    left in fp32 (exact: its values came from fp32)."""
    model.double()
    try:
        return step_gradients(method, model, batch, settings)
    finally:
        model.float()


def judge_against_fp64(
    model,
    batch: SFTBatch,
    methods: list[str],
    settings: MethodSettings,
    *,
    baseline: str = "bp",
    reference_method: str | None = None,
    reference: Step | None = None,
    steps: StepOf | None = None,
) -> list[MethodComparison]:
    """fp32 exactness judged against float64 (module docstring): run `baseline` and each method on
    the fp32 model, then `reference_method` (default: the baseline) on the same weights upcast to
    float64 (exact), and restore the model to fp32 (exact). Returns the baseline's comparison
    first (judge_baseline: is the reference a reference?), then one per method (judge_fp32_step).

    reference_method: a cheaper exact method for the fp64 step where the baseline's fp64 step
    does not fit (standard BP keeps T x T attention probabilities per layer in fp64 on CUDA, where
    no fused kernel takes fp64); BASELINE_SANITY still checks it against the baseline's fp32 step.
    reference: that fp64 step, already run on these weights (several judgements share one).
    steps: each method's fp32 step by name, run elsewhere on the same weights (runner/exactness.py:
    on ranks); by default step_gradients on this model."""
    if model.dtype != torch.float32:
        raise ValueError(f"judge_against_fp64 judges float32 models; got {model.dtype}")
    # the fp64 reference first, then each fp32 step judged and dropped: at most the reference,
    # the baseline's gradients and one method's are held (a Qwen3-4B embedding gradient is 1.6 GB)
    ref = reference if reference is not None else fp64_step(reference_method or baseline, model, batch, settings)
    base_step = step_gradients(baseline, model, batch, settings)
    results = [judge_baseline(baseline, f"{reference_method or baseline} fp64", base_step, ref)]
    steps = steps or _steps_on(model, batch, settings)
    for name in dict.fromkeys(m for m in methods if m != baseline):
        try:
            step = steps(name)
        except MethodUnsupported as error:  # reported, not a failure (as in compare_methods)
            results.append(MethodComparison(name, results[0].reference, None, [], unsupported=str(error)))
            continue
        results.append(judge_fp32_step(name, step, results[0], ref, base_step[1]))
        del step
    return results


# judge_low_precision: a method's bf16 error on a tensor (against the fp64 step on the same weights)
# may be this many times BP's own bf16 error on it, as tests/gpu/test_gpu.py allows StreamBP 1.5x of
# BP's error over all gradients together; per tensor the max-element errors vary more, as in fp32.
LOW_PRECISION_ERROR_FACTOR = FP32_ERROR_FACTOR


def _parameters_step(method: str, model, batch: SFTBatch, settings: MethodSettings, dtype: torch.dtype) -> Step:
    """One step of `method` with the parameters cast to `dtype` and back (exact both ways for bf16
    values in float64); buffers keep their dtype (a bf16 HF model's rotary inv_freq is fp32)."""
    own = {name: p.dtype for name, p in model.named_parameters()}
    for parameter in model.parameters():
        parameter.data = parameter.data.to(dtype)
    try:
        return step_gradients(method, model, batch, settings)
    finally:
        for name, parameter in model.named_parameters():
            parameter.data = parameter.data.to(own[name])


def judge_low_precision(
    model,
    batch: SFTBatch,
    methods: list[str],
    settings: MethodSettings,
    *,
    baseline: str = "bp",
    steps: StepOf | None = None,
) -> list[MethodComparison]:
    """bf16 exactness as the paper's Table 6 judges it: every step against `baseline`'s float64 step
    on the same weights; the baseline's own comparison first (reported, the yardstick), then each
    method's, within LOW_PRECISION_ERROR_FACTOR x the baseline's error on each tensor and the loss.
    steps: as judge_against_fp64's (each method's step run elsewhere, on the same weights)."""
    ref_loss, ref_grads = _parameters_step(baseline, model, batch, settings, torch.float64)
    base_loss, base_grads = step_gradients(baseline, model, batch, settings)
    base = MethodComparison(
        baseline,
        f"{baseline} fp64",
        tensor_diff("loss", base_loss, ref_loss, None),
        [tensor_diff(n, base_grads[n], r, None) for n, r in ref_grads.items()],
    )
    errors = {d.name: d.rel_error for d in base.grads}
    floor = torch.finfo(torch.float32).eps  # a bound above zero where the baseline's error is zero
    results = [base]
    steps = steps or _steps_on(model, batch, settings)
    for name in dict.fromkeys(m for m in methods if m != baseline):
        try:
            loss, grads = steps(name)
        except MethodUnsupported as error:
            results.append(MethodComparison(name, base.reference, None, [], unsupported=str(error)))
            continue
        bound = LOW_PRECISION_ERROR_FACTOR * base.loss.rel_error + floor
        diffs = [
            tensor_diff(n, grads[n], r, LOW_PRECISION_ERROR_FACTOR * errors[n] + floor) for n, r in ref_grads.items()
        ]
        versus = _same_precision_diffs(grads, base_grads)
        results.append(
            MethodComparison(name, base.reference, tensor_diff("loss", loss, ref_loss, bound), diffs, versus)
        )
    return results


def compare_step(
    method: str, reference: str, model, ours: tuple, ref: tuple, *, float32_modules: bool = True
) -> MethodComparison:
    """A comparison of (loss, {name: grad}) computed elsewhere (an external worker, ranks) with the
    reference's; a parameter without a gradient there counts as zeros. float32_modules: judge the
    weights of modules that compute in float32 at float32's tolerance (steps not run throughout)."""
    (loss, grads), (ref_loss, ref_grads) = ours, ref
    grads = {name: grads[name] if name in grads else torch.zeros_like(g) for name, g in ref_grads.items()}
    return MethodComparison(
        method=method,
        reference=reference,
        loss=tensor_diff("loss", loss, ref_loss, TOLERANCE.get(model.dtype)),
        grads=_grad_diffs(grads, ref_grads, _judging_dtypes(model) if float32_modules else {}),
    )
