"""What the tensors a StreamBP step makes are for, told to a memory recorder that asks.

A memory timeline (sbpbench's `sbp run --timeline`) splits the bytes at the peak by kind. The
kinds only this package can name are its own buffers: the layer inputs it keeps (checkpoints),
the keys/values of all positions (K/V buffers), their fp32 gradient sums (dK/dV sums), the fp32
sums of the chunks' weight gradients (gradients) and what a head chunk makes (logits). Two calls
tell a listener about them, the step's hooks (hooks.py) carrying it:

    with allocating(listener, KV_BUFFERS): keys = x.new_empty(...)   # what the block allocates is of this kind
    note(listener, CHECKPOINTS, layer_input)                         # an existing tensor is of this kind

A listener has `begin(kind) -> previous`, `end(previous)` and `note(kind, tensors)`. Without one
(None), `allocating` returns one shared `nullcontext` and `note` returns at once: a step not
recorded runs exactly as before.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch

CHECKPOINTS = "checkpoints"  # layer inputs X_l kept for the layer backward (placement.py), and their host copies
KV_BUFFERS = "K/V buffers"  # (B, kv_heads, T, head_dim) keys and values of all positions (attention.py)
KV_GRAD_SUMS = "dK/dV sums"  # their fp32 gradient sums over later chunks (layer_backward.py)
GRADIENTS = "gradients"  # fp32 sums of the chunks' weight gradients, and .grad they round to (grad_accum.py)
LOGITS = "logits"  # a head chunk's logits, its loss terms and their backward (head.py)
CARRIED_STATES = "carried states"  # each chunk's start conv tail and recurrent state (carried_state.py)
KINDS = (CHECKPOINTS, KV_BUFFERS, KV_GRAD_SUMS, GRADIENTS, LOGITS, CARRIED_STATES)

_NOTHING = nullcontext()


class KindListener(Protocol):
    def begin(self, kind: str) -> object:
        """Allocations from now on are of `kind`; returns what to restore."""

    def end(self, previous: object) -> None:
        """Restore what `begin` returned."""

    def note(self, kind: str, tensors: tuple[torch.Tensor, ...]) -> None:
        """These tensors' storages are of `kind` from now on."""


class _Allocating:
    __slots__ = ("kind", "listener", "previous")

    def __init__(self, listener: KindListener, kind: str):
        self.listener, self.kind = listener, kind

    def __enter__(self) -> None:
        self.previous = self.listener.begin(self.kind)

    def __exit__(self, *exc) -> None:
        self.listener.end(self.previous)


def allocating(listener: KindListener | None, kind: str) -> AbstractContextManager:
    """What the block allocates is of `kind` (nothing happens without a listener)."""
    return _NOTHING if listener is None else _Allocating(listener, kind)


def note(listener: KindListener | None, kind: str, *tensors: torch.Tensor | None) -> None:
    """The storages of `tensors` (None skipped) are of `kind` (nothing happens without a listener)."""
    if listener is not None:
        listener.note(kind, tuple(t for t in tensors if t is not None))
