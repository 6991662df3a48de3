"""StreamBPConfig: how the trainers run `stream_backward` (chunk sizes, checkpoint placement)."""

from __future__ import annotations

from dataclasses import dataclass

from ..core import DEFAULT_CHUNK_SIZE, DEFAULT_LOGITS_CHUNK_SIZE, Placement


@dataclass(frozen=True, kw_only=True)
class StreamBPConfig:
    """chunk_size: positions per chunk in the checkpoint pass and the layer backward;
    logits_chunk_size: positions per chunk of the LM head and loss; checkpoints: where the layer
    inputs live between the two ("gpu", "cpu", "recompute:K", "cpu+recompute:K",
    "cpu+recompute:K+spill"; sbpbench/core/placements/placement.py). None of them changes the gradients."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
    logits_chunk_size: int = DEFAULT_LOGITS_CHUNK_SIZE
    checkpoints: str | Placement = "gpu"  # held parsed: each training step gets the Placement

    def __post_init__(self):
        for name in ("chunk_size", "logits_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"StreamBPConfig.{name} must be a positive integer, got {value!r}")
        # raises ValueError naming the accepted placements
        object.__setattr__(self, "checkpoints", Placement.parse(self.checkpoints))
