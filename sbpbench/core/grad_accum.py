"""Accumulating per-chunk weight gradients without compounding low-precision rounding.

Standard BP computes a weight gradient in one matmul whose reduction over all T positions runs in
fp32 inside the kernel and is rounded to bf16 once. Streaming produces one partial gradient per
chunk; summing T/c partials in bf16 would round T/c times. For bf16/fp16 parameters the partials
are therefore summed in an fp32 buffer and rounded once when the module is done, costing one fp32
copy of the module's parameters: 0.72 GiB for a Qwen3-8B layer, 2.32 GiB for its lm_head during
the head phase. Full-precision parameters accumulate straight into .grad as autograd does.
core/README.md, "fp32 gradient accumulation" and "Embedding and tied weights".
"""

from __future__ import annotations

import torch

from .memory_kinds import GRADIENTS, KindListener, allocating

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class ChunkGradAccumulator:
    """Use: create before the chunk loop of a module, `collect()` after each chunk's backward,
    `finish()` after the loop (once; later calls do nothing). Pre-existing .grad is added last,
    as autograd's accumulation would."""

    def __init__(self, params: list[torch.nn.Parameter], fp32: bool = True, kinds: KindListener | None = None):
        self._kinds = kinds  # told that the sums are gradients (memory_kinds.py)
        # Deduplicate shared (tied) parameters; keep order stable.
        unique = {id(p): p for p in params if p.requires_grad}
        self._low = [p for p in unique.values() if fp32 and p.dtype in _LOW_PRECISION]
        self._saved = {id(p): p.grad for p in self._low}
        self._sums: dict[int, torch.Tensor] = {}
        for p in self._low:
            p.grad = None

    def collect(self) -> None:
        for p in self._low:
            if p.grad is None:
                continue
            total = self._sums.get(id(p))
            if total is None:
                with allocating(self._kinds, GRADIENTS):
                    self._sums[id(p)] = p.grad.float()
            else:
                total.add_(p.grad)
            p.grad = None

    def round_sums(self) -> None:
        """Round the fp32 sums to the parameters' dtype now, freeing the fp32 buffers; later
        gradients (`collect()`) are then added in that dtype. For a tied embedding: the head's
        chunks are summed in fp32, then the embedding's gradient is added to that sum before it
        meets the pre-existing .grad, the order in which autograd accumulates a shared weight."""
        self.collect()
        for p in self._low:
            if id(p) in self._sums:
                with allocating(self._kinds, GRADIENTS):
                    self._sums[id(p)] = self._sums[id(p)].to(p.dtype)

    def finish(self) -> None:
        self.collect()
        for p in self._low:
            total = self._sums.pop(id(p), None)
            saved = self._saved.pop(id(p))
            if total is None:
                p.grad = saved
                continue
            with allocating(self._kinds, GRADIENTS):
                p.grad = total.to(p.dtype) if saved is None else saved.add_(total.to(p.dtype))
        self._low = []  # done: a second finish() is a no-op
