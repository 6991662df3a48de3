"""StreamBP from sbpbench.core, behind the common method signature.

`reporting_progress(callback)` hands core's per-layer progress callback (core/stream.py
LayerProgress) to every StreamBP step run inside it, and `timing_phases()` gives each a PhaseTimer
(core/phases.py): a measuring caller (the worker) sets them around its steps without the registry's
(model, batch, settings) signature growing an argument that no other method reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ..core import LayerProgress, PhaseTimer, stream_backward
from ..data import Batch

_PROGRESS: ContextVar[LayerProgress | None] = ContextVar("streambp_progress", default=None)
_TIMERS: ContextVar[list[PhaseTimer] | None] = ContextVar("streambp_timers", default=None)
_ON_PHASE: ContextVar[Callable[[str | None], None] | None] = ContextVar("streambp_on_phase", default=None)


@contextmanager
def reporting_progress(callback: LayerProgress | None) -> Iterator[None]:
    """StreamBP steps run inside call `callback(done, num_layers)` per layer of their backward."""
    token = _PROGRESS.set(callback)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


@contextmanager
def timing_phases(on_phase: Callable[[str | None], None] | None = None) -> Iterator[list[PhaseTimer]]:
    """Each StreamBP step run inside gets a PhaseTimer, appended to the yielded list in step order;
    the caller resolves them after the steps (on CUDA each resolve synchronises the device).
    on_phase: told each phase the step enters and leaves (PhaseTimer's), e.g. a memory recorder."""
    timers: list[PhaseTimer] = []
    token, told = _TIMERS.set(timers), _ON_PHASE.set(on_phase)
    try:
        yield timers
    finally:
        _TIMERS.reset(token)
        _ON_PHASE.reset(told)


def streambp(model, batch: Batch, settings) -> torch.Tensor:
    timers = _TIMERS.get()
    timer = None
    if timers is not None:
        timer = PhaseTimer(on_phase=_ON_PHASE.get())
        timers.append(timer)
    return stream_backward(
        model,
        batch.input_ids,
        objective=batch.objective(),
        attention_mask=batch.attention_mask,
        chunk_size=settings.chunk_size,
        logits_chunk_size=settings.logits_chunk_size,
        fp32_grad_accumulation=settings.fp32_grad_accumulation,
        progress=_PROGRESS.get(),
        checkpoints=settings.checkpoints,
        timer=timer,
        chunk_attention=settings.chunk_attention,
    )
