"""Where a StreamBP step's time goes: seconds per phase, summed over layers and chunks
(core/README.md, "Phase times").

A caller passes a `PhaseTimer` to `stream_backward(timer=...)`, then calls `resolve()` once the step
is done. Without a timer the step runs exactly as before: no event, no clock read.

Clocks. On a CUDA device each phase boundary is an event recorded on the stream the phase runs on;
`resolve()` synchronises the device once and reads the events' elapsed times. Nothing inside the step
waits for them. On a CPU each boundary reads `time.perf_counter()`.

Phases are exclusive on a stream: one opened inside another (a host copy inside the checkpoint pass,
on a CPU) pauses the outer one until it closes, so a stream's phases never count a second twice.
On CUDA the host copies run on a side stream, beside the compute stream's phases ("overlapped"); the
wait they leave on the compute stream is its own phase. `other_s` is the rest of the step on the
compute stream: the embedding's backward, gradient rounding and sync, the host's launch gaps.

The names are measure/flops.py's streambp phases plus the three with no FLOPs, so a table can put
achieved TFLOP/s beside each (tests/exactness/test_phases.py checks that they agree).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from .cuda_calls import CUDA_CALLS, CudaCalls

CHECKPOINT_PASS = "checkpoint pass"  # the model's forward without a graph, keeping the layer inputs
HEAD = "head"  # final norm + lm_head + objective, forward and backward, chunk by chunk
KV_CAPTURE = "K/V capture"  # per layer: the keys/values of all T positions, no graph
CHUNK_FORWARD = "chunk forward"  # per layer and chunk: the layer's forward with a graph
CHUNK_BACKWARD = "chunk backward"  # per layer and chunk: autograd backward, dX, the gradient sums
REBUILD = "rebuild"  # recompute placements: layer inputs rebuilt from a kept one
HOST_COPIES = "host copies"  # offload placements: layer inputs to and from the host
COPY_WAITS = "copy waits"  # the compute stream waiting for a copy back to arrive
PHASES = (CHECKPOINT_PASS, HEAD, KV_CAPTURE, CHUNK_FORWARD, CHUNK_BACKWARD, REBUILD, HOST_COPIES, COPY_WAITS)


@dataclass(frozen=True)
class PhaseTimes:
    """One step's seconds per phase (every name of PHASES, 0.0 where it did not run); step_s from the
    step's first mark to its last; other_s, the step's compute-stream time outside every phase (not
    below 0: events round to about a microsecond); overlapped, the phases that ran on a side stream,
    beside the compute stream's."""

    seconds: dict[str, float]
    step_s: float
    other_s: float
    overlapped: frozenset[str] = frozenset()


class _HostClock:
    """A CPU step: the host does the work, so the host's clock times it."""

    def mark(self, stream) -> float:
        return time.perf_counter()

    def resolve(self) -> None:
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


class _EventClock:
    """A CUDA step: an event per boundary on the phase's stream, read after one synchronize."""

    def __init__(self, calls: CudaCalls, device: torch.device):
        self.calls, self.device = calls, device

    def mark(self, stream):
        event = self.calls.new_event(timing=True)
        event.record(stream)
        return event

    def resolve(self) -> None:
        self.calls.synchronize(self.device)

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1000  # milliseconds


@dataclass
class _Open:
    """The phases open on one stream, innermost last, and the mark its current segment began at."""

    names: list[str] = field(default_factory=list)
    since: object = None


class PhaseTimer:
    """timer = PhaseTimer(); stream_backward(..., timer=timer); ...; times = timer.resolve().

    One timer per step. calls: the CUDA runtime as the timer uses it (cuda_calls.py); tests pass a
    recording stand-in. on_phase(name): called as the compute stream enters a phase and as it
    leaves one, with the innermost phase open on it then (None: none), so a memory recorder can
    mark where the step is (side-stream phases are not its)."""

    def __init__(self, calls: CudaCalls = CUDA_CALLS, on_phase: Callable[[str | None], None] | None = None):
        self._calls = calls
        self._on_phase = on_phase
        self._clock: _HostClock | _EventClock | None = None
        self._compute = None  # the stream the step runs on (None on a CPU)
        self._open: dict[int, _Open] = {}  # stream key -> its open phases
        self._segments: list[tuple[str, object, object, bool]] = []  # (phase, start, end, on compute)
        self._step: tuple[object, object] | None = None
        self._times: PhaseTimes | None = None

    def start(self, device: torch.device) -> None:
        """The step begins on `device`: choose the clock, mark the step's start."""
        assert self._clock is None, "a PhaseTimer times one step"
        if self._calls.runs_async(device):
            self._clock = _EventClock(self._calls, device)
            self._compute = self._calls.current_stream(device)
        else:
            self._clock = _HostClock()
        self._step = (self._clock.mark(self._compute), None)

    def finish(self) -> None:
        """The step's work is all queued: mark its end."""
        self._step = (self._step[0], self._clock.mark(self._compute))

    @contextmanager
    def phase(self, name: str, stream=None) -> Iterator[None]:
        """Time the block as `name`, on `stream` (default: the compute stream); an open phase on the
        same stream pauses meanwhile."""
        assert name in PHASES, name
        if self._clock is None:  # before start(): a store made outside a timed step
            yield
            return
        on_compute = stream is None or stream is self._compute or self._compute is None
        stream = self._compute if stream is None else stream
        key = id(self._compute) if on_compute else id(stream)
        state = self._open.setdefault(key, _Open())
        mark = self._clock.mark(stream)
        if state.names:  # pause the enclosing phase
            self._segments.append((state.names[-1], state.since, mark, on_compute))
        state.names.append(name)
        state.since = mark
        tell = self._on_phase if on_compute else None
        if tell is not None:
            tell(name)
        try:
            yield
        finally:
            mark = self._clock.mark(stream)
            self._segments.append((state.names.pop(), state.since, mark, on_compute))
            state.since = mark  # the enclosing phase, if any, resumes here
            if tell is not None:
                tell(state.names[-1] if state.names else None)

    def resolve(self) -> PhaseTimes:
        """The step's PhaseTimes; the first call synchronises the device once (CUDA), later ones
        return the same."""
        if self._times is None:
            assert self._step is not None and self._step[1] is not None, "resolve() after the step finished"
            clock = self._clock
            clock.resolve()
            seconds = dict.fromkeys(PHASES, 0.0)
            inside, overlapped = 0.0, set()
            for name, start, end, on_compute in self._segments:
                elapsed = clock.seconds(start, end)
                seconds[name] += elapsed
                if on_compute:
                    inside += elapsed
                else:
                    overlapped.add(name)
            step_s = clock.seconds(*self._step)
            self._times = PhaseTimes(seconds, step_s, max(0.0, step_s - inside), frozenset(overlapped))
        return self._times


def timed(timer: PhaseTimer | None, name: str, stream=None) -> AbstractContextManager:
    """timer.phase(name, stream), or nothing without a timer."""
    return nullcontext() if timer is None else timer.phase(name, stream)
