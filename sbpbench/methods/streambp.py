"""StreamBP from sbpbench.core, behind the common method signature.

The step's StreamConfig is made from the method settings by field name: a knob core reads is a
field of both, and reaches the step without a line here. What a measuring caller (the worker, the
estimator) watches of the steps it runs goes into their StepHooks through `step_hooks(...)`, a
context around the steps, so the registry's (model, batch, settings) signature grows no argument
that no other method reads:

    with step_hooks(on_store=stores.append, on_kernel=kernels.add): step.run()

`reporting_progress(callback)` and `timing_phases()` are two such contexts: per-layer progress,
and a PhaseTimer for each step (core/phases.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import fields, replace

import torch

from ..core import LayerProgress, PhaseTimer, StreamConfig, stream_backward
from ..core.internal import SteeredHooks
from ..data import Batch

_HOOKS: ContextVar[SteeredHooks | None] = ContextVar("streambp_hooks", default=None)
_TIMERS: ContextVar[list[PhaseTimer] | None] = ContextVar("streambp_timers", default=None)
_ON_PHASE: ContextVar[Callable[[str | None], None] | None] = ContextVar("streambp_on_phase", default=None)
# hooks that are told something: a nested context's callback runs after the outer one's
_CALLBACKS = ("progress", "on_store", "on_kernel", "on_chunk_call", "on_capture")


def _both(outer, inner):
    if outer is None or inner is None:
        return inner if outer is None else outer

    def call(*args):
        outer(*args)
        inner(*args)

    return call


@contextmanager
def step_hooks(**given) -> Iterator[SteeredHooks]:
    """StreamBP steps run inside get these hook fields (StepHooks' and SteeredHooks'), on top of an enclosing context's: a
    callback is added to the outer one's, any other field replaces it."""
    current = current_hooks()
    merged = {n: _both(getattr(current, n), v) if n in _CALLBACKS else v for n, v in given.items()}
    token = _HOOKS.set(replace(current, **merged))
    try:
        yield current_hooks()
    finally:
        _HOOKS.reset(token)


def current_hooks() -> SteeredHooks:
    """The hooks a StreamBP step run here would get: StepHooks, with the estimator's steering."""
    return _HOOKS.get() or SteeredHooks()


def reporting_progress(callback: LayerProgress | None):
    """StreamBP steps run inside call `callback(done, num_layers)` per layer of their backward."""
    return step_hooks(progress=callback)


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


def stream_config(settings) -> StreamConfig:
    """StreamConfig from the method settings: every field of StreamConfig by its name."""
    return StreamConfig(**{f.name: getattr(settings, f.name) for f in fields(StreamConfig)})


def streambp(model, batch: Batch, settings, sequence_parallel=None) -> torch.Tensor:
    """sequence_parallel: the ranks sharing each sequence (core SequenceParallel), which take
    unpadded rows; the benchmark's right-padded rows run unmasked there (`unpadded_mask`)."""
    hooks, timers = current_hooks(), _TIMERS.get()
    if timers is not None:
        timers.append(PhaseTimer(on_phase=_ON_PHASE.get()))
        hooks = replace(hooks, timer=timers[-1])
    mask = batch.attention_mask if sequence_parallel is None else unpadded_mask(batch.attention_mask)
    return stream_backward(
        model,
        batch.input_ids,
        objective=batch.objective(),
        attention_mask=mask,
        config=stream_config(settings),
        hooks=hooks,
        sequence_parallel=sequence_parallel,
    )


def unpadded_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """None for rows whose padding is all at their end: pads come after every real token and predict
    nothing (their labels are -100), so causal attention without the mask gives the real tokens what
    the mask gives, and the same gradient. Any other padding is kept, for the step to refuse."""
    if attention_mask is None:
        return None
    real = attention_mask.bool()
    # real tokens first: no real token after a pad (ops on the mask alone, so the memory simulator's
    # fake-tensor step runs them for real and can read the answer; an arange would be fake there)
    return None if bool((real[:, 1:] <= real[:, :-1]).all()) else attention_mask
