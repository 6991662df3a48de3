"""Predicting a deep model from two shallow ones, for long sequences where a full-depth fake run
takes minutes.

When every decoder layer has the same shape and attention type, each memory term of a step is
affine in the depth L: weights, gradients and optimizer moments per layer, plus per layer what
stays alive at the peak (bp: its saved activations; ckpt and streambp: its input checkpoint),
while the peak itself happens in a phase that does not depend on L (the head, or the top layer's
backward). So the full-depth value is v(2) + (L - 2) * (v(3) - v(2)); with recompute:K, along depths of one
remainder mod K (`probe_depths`). tests/test_simulate_depth.py checks this against full-depth runs
to the byte; models whose layers differ (Gemma 3's sliding
and global layers) are always run at full depth.

Each shallow model is itself predicted at T from shorter sequences (length.py) unless `exact`:
depth outermost, since its affine law holds at any fixed T, length innermost, since its fit needs
the step's instants, which only a run at one depth has. `exact` runs the full step: the point's
own depth and length, nothing extrapolated.
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import partial

from ..config import RunSpec
from ..core.placement import Placement
from ..methods import MethodFn
from ..models import load_config
from ..records import ResultRow
from .estimate import estimate_point, judge, margin_bytes
from .length import Note, predict

AFFINE_COLUMNS = (
    "num_params",
    "trainable_params",
    "weights_bytes",
    "grads_bytes",
    "optimizer_state_bytes",
    "baseline_bytes",
    "peak_allocated_bytes",
    "activation_peak_bytes",
    "model_flops",
    "host_pinned_peak_bytes",
    "transfer_bytes",
)
MIN_DEPTH = 6  # below this a full-depth run costs about as much as the two shallow ones


def uniform_layers(model: str) -> bool:
    """Every decoder layer the same: one attention type (no sliding/global mix)."""
    config = load_config(model)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and len(set(layer_types)) > 1:
        return False
    return not getattr(config, "sliding_window_pattern", None)


def probe_depths(depth: int, recompute_every: int = 1) -> tuple[int, int] | None:
    """The two shallow depths whose estimates give the full one, or None to run at full depth.

    Without recompute the terms are affine in L (2 and 3 layers). With recompute:K the device holds
    ceil(L/K) kept inputs and the top segments' rebuilt ones, so the terms are affine along depths
    of the same remainder mod K: the first with two segments, and one more segment."""
    k = recompute_every
    low = max(2, k + 1)
    low += (depth - low) % k  # low = depth (mod k)
    high = low + k
    return (low, high) if high < depth and depth >= MIN_DEPTH else None


def estimate_point_by_depth(
    spec: RunSpec,
    *,
    target: str = "cuda",
    gpu_memory_bytes: int | None = None,
    host_memory_bytes: int | None = None,
    method: MethodFn | None = None,
    exact: bool = False,
    note: Note | None = None,
) -> ResultRow:
    """estimate_point's row, from two shallower models when that is exact (see above), each
    predicted from shorter sequences (length.py) unless `exact`. note: progress lines."""
    estimator = None if exact else partial(predict, note=note)
    depth = spec.num_layers or load_config(spec.model).num_hidden_layers
    every = Placement.parse(spec.settings.checkpoints).recompute_every if spec.settings.checkpoints else 1
    depths = None if exact else probe_depths(depth, every)
    if depths is None or not uniform_layers(spec.model):
        return estimate_point(
            spec,
            target=target,
            gpu_memory_bytes=gpu_memory_bytes,
            host_memory_bytes=host_memory_bytes,
            method=method,
            estimator=estimator,
        )
    low, high = depths
    shallow = estimate_point(replace(spec, num_layers=low), target=target, method=method, estimator=estimator)
    row = estimate_point(replace(spec, num_layers=high), target=target, method=method, estimator=estimator)
    if "error" in (shallow.status, row.status):
        return row
    steps = (depth - low) // (high - low)  # whole segments: depth = low (mod high - low)
    for column in AFFINE_COLUMNS:
        a, b = getattr(shallow, column), getattr(row, column)
        if a is not None and b is not None:
            setattr(row, column, type(b)(a + steps * (b - a)))
    row.num_layers = depth  # as spec_fields records the full model, so the row keys as the full run's
    row.margin_bytes = margin_bytes(row.activation_peak_bytes)
    # a layer counted from the top of the `high`-layer model is the same layer from the top of the full one
    row.peak_phase = re.sub(r"layer (\d+)", lambda m: f"layer {int(m.group(1)) + depth - high}", row.peak_phase)
    return judge(row, gpu_memory_bytes, host_memory_bytes)
