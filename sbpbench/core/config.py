"""StreamConfig: StreamBP's knobs, checked once when the config is made.

None of them changes the loss or the gradients beyond rounding; they trade memory against time:
    chunk_size              positions per chunk in the checkpoint pass and the layer backward
    logits_chunk_size       positions per chunk of the LM head and the objective
    fp32_grad_accumulation  sum the chunks' weight gradients in fp32 where a weight is bf16/fp16
    checkpoints             where the layer inputs wait for their backward (placements/placement.py)
    chunk_attention         the kernel of a chunk's attention over its prefix, by name or a picker
                            per call (kernels/kernel_choice.py)
A training loop makes one and passes it to every step; the trainers take the same object.
"""

from __future__ import annotations

from dataclasses import dataclass

from .kernels.kernel_choice import AUTO, KernelPicker, check_chunk_attention
from .placements.placement import Placement

DEFAULT_CHUNK_SIZE = 500  # the paper's layer partition for its max-length runs (appendix D)
DEFAULT_LOGITS_CHUNK_SIZE = 100  # the paper's logits partition


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """StreamBP's knobs (module docstring). A bad value is a ValueError naming the field, here,
    before any step; `checkpoints` is held parsed, as a Placement."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
    logits_chunk_size: int = DEFAULT_LOGITS_CHUNK_SIZE
    fp32_grad_accumulation: bool = True
    checkpoints: Placement | str = "gpu"
    chunk_attention: str | KernelPicker = AUTO

    def __post_init__(self) -> None:
        for name in ("chunk_size", "logits_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"StreamConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.fp32_grad_accumulation, bool):
            raise ValueError(
                f"StreamConfig.fp32_grad_accumulation must be True or False, got {self.fp32_grad_accumulation!r}"
            )
        if not isinstance(self.checkpoints, Placement):  # a ValueError naming the placements accepted
            object.__setattr__(self, "checkpoints", Placement.parse(self.checkpoints))
        check_chunk_attention(self.chunk_attention)  # the name; the device is checked at the step
