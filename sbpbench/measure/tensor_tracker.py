"""Live tensor bytes on any device: the CPU analogue of torch.cuda.memory_allocated().

A TorchDispatchMode sees every aten op, forward and backward, including factory functions. Each
storage an op creates (an output storage that none of its inputs owned) is counted when it is
created and uncounted by a weakref finalizer when its last tensor dies, the way torch's own
`torch.distributed._tools.mem_tracker` does. Tensors that existed before the mode (weights,
resident gradients) are not counted, so `peak_bytes` is the activation peak above them.
Deterministic for a given program, which is why tests may assert ratios of it.

With `limit_bytes`, an op that takes the live bytes over the limit raises TrackedOutOfMemoryError
right after it runs: the CPU stand-in for a CUDA out-of-memory error on a smaller device.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TrackedOutOfMemoryError(RuntimeError):
    """The tracked live bytes went over the tracker's limit (the CPU analogue of a CUDA OOM)."""


@dataclass(frozen=True)
class Allocation:
    numel: int
    nbytes: int
    op: str


class LiveTensorTracker(TorchDispatchMode):
    """with LiveTensorTracker() as tracker: step(); tracker.peak_bytes, tracker.largest."""

    def __init__(self, granularity_bytes: int = 1, limit_bytes: int | None = None):
        super().__init__()
        if granularity_bytes < 1:
            raise ValueError("granularity_bytes must be >= 1")
        self.limit_bytes = limit_bytes
        self.granularity_bytes = granularity_bytes  # e.g. 512 to round as the CUDA caching allocator does
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest = Allocation(0, 0, "")
        self._refs: dict[int, weakref.ref] = {}

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now (as torch.cuda.reset_peak_memory_stats)."""
        self.peak_bytes = self.live_bytes
        self.largest = Allocation(0, 0, "")

    def _rounded(self, nbytes: int) -> int:
        g = self.granularity_bytes
        return -(-nbytes // g) * g

    def _forget(self, key: int, nbytes: int, _ref=None) -> None:
        if self._refs.pop(key, None) is not None:
            self.live_bytes -= nbytes

    def _track(self, tensor: torch.Tensor, op: str) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        nbytes = storage.nbytes()
        if key in self._refs or nbytes == 0:
            return
        rounded = self._rounded(nbytes)
        self._refs[key] = weakref.ref(storage, lambda ref, k=key, n=rounded: self._forget(k, n, ref))
        self.live_bytes += rounded
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        numel = nbytes // tensor.element_size()
        if numel > self.largest.numel:
            self.largest = Allocation(numel, nbytes, op)

    def _run(self, func, args, kwargs):
        """Run one op. A subclass may run it elsewhere (the simulator runs ops on real tensors
        outside its fake-tensor mode); what it returns is counted the same way."""
        return func(*args, **kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self._run(func, args, kwargs)
        inputs = {
            id(t.untyped_storage())
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and not t.is_meta
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta and id(t.untyped_storage()) not in inputs:
                self._track(t, str(func))
        if self.limit_bytes is not None and self.live_bytes > self.limit_bytes:
            raise TrackedOutOfMemoryError(
                f"tracked live tensors reached {self.live_bytes:,} B, over the limit of {self.limit_bytes:,} B ({func})"
            )
        return out
