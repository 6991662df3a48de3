"""What a point's memory timeline shares between the measured runner and the estimator: what its
resident bytes are (by kind), the settings a timeline file repeats, and the file's name."""

from __future__ import annotations

import hashlib
import json
import re

import torch

from ..config.run import RunSpec
from ..measure.timeline.data import GRADIENTS, OPTIMIZER_STATE, OTHER, WEIGHTS
from ..methods.step import TrainingStep
from ..methods.training import optimizer_state_tensors
from ..records import ResultRow, row_key
from .rows import spec_fields

# The row columns a timeline file repeats, so that it reads alone (a figure's title and legend).
POINT_COLUMNS = (
    "model", "num_layers", "method", "objective", "step", "lora_rank", "seq_len", "batch_size", "dtype",
    "device", "device_name", "protocol", "checkpoints", "chunk_size", "logits_chunk_size", "memory_limit_bytes",
    "attention_kernel",
)  # fmt: skip
MEASURED, PREDICTED, SNAPSHOT = ".measured.json", ".predicted.json", ".snapshot.pickle"


def resident_kinds(step: TrainingStep, granularity_bytes: int = 1) -> dict[str, int]:
    """The bytes resident before the step, by kind: weights, gradients, optimizer state, and the
    batch as other. Each storage once (tied weights), rounded up to granularity_bytes as an
    allocator rounds it; they sum to storage_bytes(step.resident_tensors()) at the same rounding."""
    model = step.model
    groups = [
        (WEIGHTS, list(model.parameters())),
        (GRADIENTS, [p.grad for p in model.parameters() if p.grad is not None]),
        (OPTIMIZER_STATE, optimizer_state_tensors(step.optimizer) if step.optimizer is not None else []),
        (OTHER, [t for t in vars(step.batch).values() if isinstance(t, torch.Tensor)]),
    ]
    seen: set[int] = set()
    kinds: dict[str, int] = {}
    for kind, tensors in groups:
        total = 0
        for tensor in tensors:
            storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()
            if id(storage) not in seen:
                seen.add(id(storage))
                total += -(-storage.nbytes() // granularity_bytes) * granularity_bytes
        kinds[kind] = total
    return kinds


def point_of(row: ResultRow) -> dict:
    """The settings a timeline repeats from its row (None where the row has none)."""
    values = row.as_dict()
    return {name: values.get(name) for name in POINT_COLUMNS}


def timeline_stem(spec: RunSpec) -> str:
    """A file name for the point's timelines, the same on every rerun of the point: a readable part
    (model, method, placement, T) and a hash of the row's key and device, which tell every point apart."""
    fields = spec_fields(spec)
    key = json.dumps([*row_key(ResultRow(**fields)), fields["device"]])
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    placement = spec.settings.checkpoints  # a Placement, or None for a method that reads none
    method = spec.method + (f"-{placement}" if placement is not None and str(placement) != "gpu" else "")
    readable = f"{spec.model.rstrip('/').replace('/', '-')}__{method}__T{spec.seq_len}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", readable) + f"__{digest}"
