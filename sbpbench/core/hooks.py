"""StepHooks: what a caller watches of one StreamBP step, passed to `stream_backward(..., hooks=...)`
and carried down with the step's own objects.

No hook changes the loss or the gradients. Core holds no global state that a hook replaces: a
step without hooks (`StepHooks()`) runs exactly as a step with empty ones. They travel as objects,
not context variables, because autograd runs a CUDA backward on a thread of its own.

    timer          PhaseTimer: seconds per phase of the step (phases.py)
    progress       progress(done, num_layers): 0 after the checkpoint pass and the head, then per layer
    kinds          a memory-kind listener: begin(kind) -> previous, end(previous), note(kind, tensors)
                   (memory_kinds.py), told what the step's own buffers are for
    on_store       on_store(store): each checkpoint store the step makes (placements/placement.py)
    on_kernel      on_kernel(name): the kernel each chunk call ran
    on_chunk_call  on_chunk_call(shape): each chunk call's CallShape (sizes, strides, grad mode), so a
                   caller can build its kernels' graphs for those before it times a step
    on_capture     on_capture(buffer): each chunk of a layer backward's K/V capture, its KVBuffer's
                   start set, before its keys/values are made (by the layer or by its projection)

`SteeredHooks` (core/internal.py; unstable, for sbpbench's estimator and tests) adds the few ways a
measuring tool steers a step without changing its math:

    shapes_only    host copies keep shape and dtype only (fake tensors: the memory simulator)
    cuda_branch    causal_bias(num_queries, num_keys): attention takes its CUDA branch whatever the
                   device, with this lower-right bias (tests, and the simulator's fake tensors)
    sized_for      group K/V heads per attention call as a step of this many positions would
                   (the simulator's short samples of a long point)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from .kernels.kernel_choice import CallShape
from .memory_kinds import KindListener, allocating, note
from .phases import PhaseTimer, timed

# progress(done, num_layers): called with 0 once the checkpoint pass and the head are done, then
# after each layer's backward with the number of layers done. Core only calls it; what to do with
# it (print past a few seconds, log) is the caller's.
LayerProgress = Callable[[int, int], None]
CausalBias = Callable[[int, int], torch.Tensor]  # (num_queries, num_keys) -> attn_mask for SDPA


@dataclass(frozen=True, kw_only=True)
class StepHooks:
    """What a caller watches of one step (module docstring); every field optional."""

    timer: PhaseTimer | None = None
    progress: LayerProgress | None = None
    kinds: KindListener | None = None
    on_store: Callable[[object], None] | None = None
    on_kernel: Callable[[str], None] | None = None
    on_chunk_call: Callable[[CallShape], None] | None = None
    on_capture: Callable[[object], None] | None = None

    def timed(self, phase: str, stream=None) -> AbstractContextManager:
        """The block timed as `phase` (nothing without a timer)."""
        return timed(self.timer, phase, stream)

    def allocating(self, kind: str) -> AbstractContextManager:
        """What the block allocates is of `kind` (nothing without a listener)."""
        return allocating(self.kinds, kind)

    def note(self, kind: str, *tensors: torch.Tensor | None) -> None:
        """These tensors' storages are of `kind` (nothing without a listener)."""
        note(self.kinds, kind, *tensors)


@dataclass(frozen=True, kw_only=True)
class SteeredHooks(StepHooks):
    """StepHooks and the ways a measuring tool steers a step (module docstring)."""

    shapes_only: bool = False
    cuda_branch: CausalBias | None = None
    sized_for: int | None = None


NO_HOOKS = StepHooks()
NOT_STEERED = SteeredHooks()


def steered(hooks: StepHooks) -> SteeredHooks:
    """The steering of a step's hooks: its own where they are SteeredHooks, else none."""
    return hooks if isinstance(hooks, SteeredHooks) else NOT_STEERED
