"""Predicting a deep model from two shallow ones, for long sequences where a full-depth fake run
takes minutes.

When every decoder layer has the same shape and attention type, each memory term of a step is
affine in the depth L: weights, gradients and optimizer moments per layer, plus per layer what
stays alive at the peak (bp: its saved activations; ckpt and streambp: its input checkpoint),
while the peak itself happens in a phase that does not depend on L (the head, or the top layer's
backward). So the full-depth value is v(2) + (L - 2) * (v(3) - v(2)). tests/test_simulate_depth.py
checks this against full-depth runs to the byte; models whose layers differ (Gemma 3's sliding
and global layers) are always run at full depth.
"""

from __future__ import annotations

import re
from dataclasses import replace

from ..config import RunSpec
from ..models import load_config
from ..records import ResultRow
from .estimate import GIB, estimate_point, margin_bytes

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
)
MIN_DEPTH = 6  # below this a full-depth run costs about as much as the two shallow ones


def uniform_layers(model: str) -> bool:
    """Every decoder layer the same: one attention type (no sliding/global mix)."""
    config = load_config(model)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and len(set(layer_types)) > 1:
        return False
    return not getattr(config, "sliding_window_pattern", None)


def estimate_point_by_depth(spec: RunSpec, *, target: str = "cuda", gpu_memory_bytes: int | None = None) -> ResultRow:
    """estimate_point's row, from the 2- and 3-layer models when that is exact (see above)."""
    depth = spec.num_layers or load_config(spec.model).num_hidden_layers
    if depth < MIN_DEPTH or not uniform_layers(spec.model):
        return estimate_point(spec, target=target, gpu_memory_bytes=gpu_memory_bytes)
    two = estimate_point(replace(spec, num_layers=2), target=target)
    three = estimate_point(replace(spec, num_layers=3), target=target)
    if "error" in (two.status, three.status):
        return three
    row = three
    for column in AFFINE_COLUMNS:
        low, high = getattr(two, column), getattr(three, column)
        if low is not None and high is not None:
            setattr(row, column, type(high)(low + (depth - 2) * (high - low)))
    row.num_layers = depth  # as spec_fields records the full model, so the row keys as the full run's
    row.margin_bytes = margin_bytes(row.activation_peak_bytes)
    # the top layer of the 3-layer model is layer depth-1 of the full one
    row.peak_phase = re.sub(r"layer (\d+)", lambda m: f"layer {int(m.group(1)) + depth - 3}", row.peak_phase)
    row.device_total_memory_bytes = gpu_memory_bytes
    row.error = ""
    row.status = "ok"
    if gpu_memory_bytes is not None and row.peak_allocated_bytes + row.margin_bytes > gpu_memory_bytes:
        need = (row.peak_allocated_bytes + row.margin_bytes) / GIB
        row.status = "oom"
        row.error = f"needs {need:.2f} GiB (peak + margin) of {gpu_memory_bytes / GIB:.2f} GiB"
    return row
