"""Live bytes of a simulated step: the CPU live-tensor tracker, run over fake tensors.

`SimulatedMemory` is a `LiveTensorTracker` (measure/tensor_tracker.py) pushed above a
FakeTensorMode, so it counts every storage the step creates, fake or real, exactly as the real
CPU measurement does, with the CUDA caching allocator's 512-byte rounding when asked. Three
additions:
- ops whose tensor arguments are all real (the batch and what is computed from it: labels,
  masks, token counts) run for real, outside the fake mode, so the step's data-dependent Python
  (`int(mask.sum())`, `if mask.any()`) works; everything touching the model stays fake;
- `hidden`: buffers a CUDA kernel allocates and frees inside one op, invisible to the dispatcher
  (cuda_attention.hidden_buffers), each rounded as a block and added to the live bytes for the
  duration of that op;
- `phase`: a label set from outside (methods/phase_labels.py); `peak_phase` is the label when the peak was set,
  `peak_kinds` the live bytes by kind then (a kernel's hidden buffers among the intermediates).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from ..measure.tensor_tracker import INTERMEDIATES, LiveTensorTracker
from .cuda_attention import EFFICIENT_BACKWARD, efficient_backward_on_fake

CUDA_ALLOCATOR_ROUNDING = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize: every block is a multiple of 512 B

_DEVICE = torch.ops.prim.device.default
HiddenBuffers = Callable[[object, tuple], list[int]]  # (aten op, its args) -> sizes of the buffers made inside it


def _all_real(args, kwargs) -> bool:
    """Whether an aten op has tensor arguments and none is fake. Aten arguments are flat: tensors,
    scalars, and lists of those, so two levels suffice (tree_leaves costs more per op)."""
    found = False
    for value in (*args, *kwargs.values()):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, FakeTensor):
                return False
            found = found or isinstance(t, torch.Tensor)
    return found


class SimulatedMemory(LiveTensorTracker):
    """with fake_mode, SimulatedMemory(...) as memory: step(); memory.peak_bytes, memory.peak_phase."""

    def __init__(self, granularity_bytes: int = 1, hidden: HiddenBuffers | None = None):
        super().__init__(granularity_bytes=granularity_bytes)
        self.hidden = hidden
        self.phase = "forward"
        self.peak_phase = ""
        self.phase_peaks: dict[str, int] = {}  # label -> the live bytes' peak within it (depth.py lifts by phase)

    def _is_meta(self, t: torch.Tensor) -> bool:
        # a FakeTensor's `is_meta` dispatches prim.device through the fake mode (~20 us a call, a few
        # calls per op); its fake_device gives the same answer as an attribute read
        return t.fake_device.type == "meta" if isinstance(t, FakeTensor) else t.is_meta

    def _run(self, func, args, kwargs):
        if _all_real(args, kwargs):
            with _disable_current_modes():  # real inputs only: run for real, below no mode
                return func(*args, **kwargs)
        if func is EFFICIENT_BACKWARD:  # torch's meta function may not match the op's schema
            out = efficient_backward_on_fake(args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # a FakeTensor's device query (autograd asks for every gradient): allocates nothing
            return func(*args, **(kwargs or {}))
        peak = self.peak_bytes
        out = super().__torch_dispatch__(func, types, args, kwargs)
        inside = self.hidden(func, args) if self.hidden is not None else []
        hidden = sum(self._rounded(n) for n in inside)
        now = self.live_bytes + hidden
        if now > self.peak_bytes:
            self.peak_bytes = now
            self.peak_kinds = dict(self.kind_bytes)
            self.peak_kinds[INTERMEDIATES] = (
                self.peak_kinds.get(INTERMEDIATES, 0) + hidden
            )  # a kernel's own buffers: the op's intermediates
        if self.peak_bytes > peak:
            self.peak_phase = self.phase
        if now > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = now
        self.observe(func, now, inside)
        return out

    def resized(self, storage) -> None:
        """A storage resized in place (FSDP2's gathered parameters): a peak it sets is the phase's."""
        peak = self.peak_bytes
        super().resized(storage)
        if self.peak_bytes > peak:
            self.peak_phase = self.phase

    def attached(self, step):
        """A context the step (methods/step.py) runs in besides this mode (nothing here; the
        recorder of instants.py watches StreamBP's chunks in it, a timeline's marks the step)."""
        return nullcontext()

    def observe(self, func, live_bytes: int, inside: list[int]) -> None:
        """Called after every op with the op, the live bytes during it (its hidden buffers included)
        and the sizes of those buffers; a subclass records them (instants.py)."""
