"""Numerical identity of methods: loss and every parameter gradient against a reference method.

The error of a tensor is max|ours - ref| / max|ref| (infinity norms), so a tensor of tiny entries
beside large ones cannot hide a wrong sign. Tolerances are the project's invariants (DESIGN.md):
fp64 1e-10, fp32 1e-5; bf16 is reported, never judged (both sides round differently by design).

A gradient that is zero in exact arithmetic (a query gradient when every query sees one key, as
at T = 2) comes out of both methods as rounding noise, where a relative error means nothing. So a
difference also passes when it is within ROUNDING_UNITS units of rounding (machine epsilon) of
the model's largest reference gradient: noise of the model's own scale, never a wrong result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..data import SFTBatch
from .registry import run_method
from .settings import MethodSettings
from .unsupported import MethodUnsupported

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
ROUNDING_UNITS = 4

# Modules that compute in float32 whatever the model dtype (Gemma3RMSNorm casts to float and back),
# so in a float64 model their weight gradients are float32 reductions, summed per chunk by
# StreamBP and over the whole sequence by standard BP: equal to float32 rounding only.
FLOAT32_COMPUTE_MODULES = ("Gemma3RMSNorm",)


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
    ours, reference = ours.detach().double().cpu(), reference.detach().double().cpu()
    if ours.shape != reference.shape:
        return TensorDiff(name, float("inf"), float("inf"), (), float("nan"), float("nan"), tolerance)
    if ours.numel() == 0:
        return TensorDiff(name, 0.0, 0.0, (), 0.0, 0.0, tolerance)
    diff = (ours - reference).abs()
    flat = int(diff.nan_to_num(nan=float("inf")).argmax())  # a NaN is the worst difference
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    max_diff = float(diff[index])
    scale = float(reference.abs().max())
    rel = max_diff / scale if scale > 0 else max_diff  # NaN propagates and fails every tolerance
    return TensorDiff(name, rel, max_diff, index, float(ours[index]), float(reference[index]), tolerance, noise_floor)


@dataclass(frozen=True)
class MethodComparison:
    method: str
    reference: str
    loss: TensorDiff | None  # None: the method cannot run here (unsupported says why)
    grads: list[TensorDiff]
    unsupported: str = ""

    @property
    def worst(self) -> TensorDiff | None:
        return max(self.grads, key=lambda d: (not d.ok, d.rel_error), default=None)

    @property
    def ok(self) -> bool:
        """Exact, or not run here: an unsupported method is reported, not a failure."""
        return self.loss is None or (self.loss.ok and all(d.ok for d in self.grads))

    def failures(self) -> list[TensorDiff]:
        return [] if self.loss is None else [d for d in [self.loss, *self.grads] if not d.ok]


def step_gradients(method, model, batch: SFTBatch, settings: MethodSettings):
    """Run one step from zero gradients; return (loss, {parameter name: grad or zeros})."""
    model.zero_grad(set_to_none=True)
    loss = run_method(method, model, batch, settings)
    grads = {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    model.zero_grad(set_to_none=True)
    return loss, grads


def _judging_dtypes(model) -> dict[str, torch.dtype]:
    """Per parameter, the precision its gradient is judged in: the model's, or float32 for modules
    that compute in float32 inside a float64 model."""
    dtypes = {name: model.dtype for name, _ in model.named_parameters()}
    if model.dtype == torch.float64:
        for module_name, module in model.named_modules():
            if type(module).__name__ in FLOAT32_COMPUTE_MODULES:
                for param_name, _ in module.named_parameters():
                    dtypes[f"{module_name}.{param_name}"] = torch.float32
    return dtypes


def _grad_diffs(grads: dict, ref_grads: dict, dtypes: dict) -> list[TensorDiff]:
    scale = max((float(g.abs().max()) for g in ref_grads.values() if g.numel()), default=0.0)
    diffs = []
    for name, ref in ref_grads.items():
        dtype = dtypes[name]
        floor = ROUNDING_UNITS * torch.finfo(dtype).eps * scale if dtype in TOLERANCE else 0.0
        diffs.append(tensor_diff(name, grads[name], ref, TOLERANCE.get(dtype), floor))
    return diffs


def compare_methods(
    model, batch: SFTBatch, methods: list[str], settings: MethodSettings, reference: str = "bp"
) -> list[MethodComparison]:
    """Run the reference and each method on the same model and batch and compare."""
    ref_loss, ref_grads = step_gradients(reference, model, batch, settings)
    results = []
    for method in methods:
        try:
            loss, grads = step_gradients(method, model, batch, settings)
        except MethodUnsupported as error:
            model.zero_grad(set_to_none=True)
            results.append(MethodComparison(method, reference, None, [], unsupported=str(error)))
            continue
        results.append(compare_step(method, reference, model, (loss, grads), (ref_loss, ref_grads)))
    return results


def compare_step(method: str, reference: str, model, ours: tuple, ref: tuple) -> MethodComparison:
    """A comparison of (loss, {name: grad}) computed elsewhere (an external worker) with the
    reference's; a parameter without a gradient there counts as zeros."""
    (loss, grads), (ref_loss, ref_grads) = ours, ref
    grads = {name: grads[name] if name in grads else torch.zeros_like(g) for name, g in ref_grads.items()}
    return MethodComparison(
        method=method,
        reference=reference,
        loss=tensor_diff("loss", loss, ref_loss, TOLERANCE.get(model.dtype)),
        grads=_grad_diffs(grads, ref_grads, _judging_dtypes(model)),
    )
