"""What the tensors a StreamBP step makes are for, told to a memory recorder that asks.

A memory timeline (sbpbench's `sbp run --timeline`) splits the bytes at the peak by kind. The
kinds only this package can name are its own buffers: the layer inputs it keeps (checkpoints),
the keys/values of all positions (K/V buffers), their fp32 gradient sums (dK/dV sums), the fp32
sums of the chunks' weight gradients (gradients) and what a head chunk makes (logits). Two seams tell a listener about them:

    with allocating(KV_BUFFERS): keys = x.new_empty(...)   # what the block allocates is of this kind
    note(CHECKPOINTS, layer_input)                         # an existing tensor is of this kind

A listener (anything with `begin(kind) -> previous`, `end(previous)` and `note(kind, tensors)`)
is installed with `listening(listener)`. Without one, `allocating` returns one shared
`nullcontext` and `note` returns at once: a step not recorded runs exactly as before. The
listener is a module global, not a context variable: autograd runs a CUDA backward on a thread
of its own, which a context variable set here would not reach.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Protocol

import torch

CHECKPOINTS = "checkpoints"  # layer inputs X_l kept for the layer backward (placement.py), and their host copies
KV_BUFFERS = "K/V buffers"  # (B, kv_heads, T, head_dim) keys and values of all positions (attention.py)
KV_GRAD_SUMS = "dK/dV sums"  # their fp32 gradient sums over later chunks (layer_backward.py)
GRADIENTS = "gradients"  # fp32 sums of the chunks' weight gradients, and .grad they round to (grad_accum.py)
LOGITS = "logits"  # a head chunk's logits, its loss terms and their backward (head.py)
KINDS = (CHECKPOINTS, KV_BUFFERS, KV_GRAD_SUMS, GRADIENTS, LOGITS)

_NOTHING = nullcontext()


class KindListener(Protocol):
    def begin(self, kind: str) -> object:
        """Allocations from now on are of `kind`; returns what to restore."""

    def end(self, previous: object) -> None:
        """Restore what `begin` returned."""

    def note(self, kind: str, tensors: tuple[torch.Tensor, ...]) -> None:
        """These tensors' storages are of `kind` from now on."""


_listener: KindListener | None = None


@contextmanager
def listening(listener: KindListener) -> Iterator[KindListener]:
    """Tell `listener` the kinds of what StreamBP allocates within the block. Does not nest."""
    global _listener
    assert _listener is None, "one memory recorder at a time"
    _listener = listener
    try:
        yield listener
    finally:
        _listener = None


class _Allocating:
    __slots__ = ("kind", "listener", "previous")

    def __init__(self, listener: KindListener, kind: str):
        self.listener, self.kind = listener, kind

    def __enter__(self) -> None:
        self.previous = self.listener.begin(self.kind)

    def __exit__(self, *exc) -> None:
        self.listener.end(self.previous)


def allocating(kind: str) -> AbstractContextManager:
    """What the block allocates is of `kind` (nothing happens without a listener)."""
    listener = _listener
    return _NOTHING if listener is None else _Allocating(listener, kind)


def note(kind: str, *tensors: torch.Tensor | None) -> None:
    """The storages of `tensors` (None skipped) are of `kind` (nothing happens without a listener)."""
    listener = _listener
    if listener is not None:
        listener.note(kind, tuple(t for t in tensors if t is not None))
