"""Settings shared by every method; recorded with each measurement."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..core import DEFAULT_CHUNK_SIZE, DEFAULT_LOGITS_CHUNK_SIZE


@dataclass(frozen=True, kw_only=True)
class MethodSettings:
    chunk_size: int = DEFAULT_CHUNK_SIZE  # StreamBP layer partition (positions per chunk)
    logits_chunk_size: int = DEFAULT_LOGITS_CHUNK_SIZE  # StreamBP head partition
    fp32_grad_accumulation: bool = True  # StreamBP: sum bf16 chunk gradients in fp32

    def __post_init__(self):
        for name in ("chunk_size", "logits_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def as_dict(self) -> dict:
        return asdict(self)
