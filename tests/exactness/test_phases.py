"""Phase times of a StreamBP step (core/phases.py): on the CUDA stand-in every phase's events lie on
its stream in order, the host copies on the side stream and the waits for them on the compute
stream, and the device is synchronised once per step, when the times are read; on a CPU the phases
and the rest add up to the step's wall time without counting a second twice. The names agree with
measure/flops.py's and with the row's columns."""

from __future__ import annotations

import time

import pytest
import torch

from sbpbench.core import PhaseTimer, phases
from sbpbench.core.phases import COPY_WAITS, HOST_COPIES, PHASES, REBUILD
from sbpbench.core.placements.placement import Placement
from sbpbench.data import make_batch
from sbpbench.measure.flops import phase_flops
from sbpbench.records import ResultRow
from sbpbench.records.schema import phase_column

from ..conftest import streamed, tiny_model
from ..cuda_standin import RecordingCalls, route_stores
from .test_placement import _deep_model

COMPUTED = ("checkpoint pass", "head", "K/V capture", "chunk forward", "chunk backward")  # every step runs them


class LoggingTimer(PhaseTimer):
    """A PhaseTimer that logs each phase it opens: (name, "side" or "compute")."""

    def __init__(self, calls):
        super().__init__(calls)
        self.log: list[tuple[str, str]] = []

    def phase(self, name, stream=None):
        self.log.append((name, "compute" if stream is None else "side"))
        return super().phase(name, stream)


def _standin_step(monkeypatch, checkpoints: str, *, timer: bool = True):
    """One fp64 step on the stand-in (store and timer): (calls, timer, the default stream's op count
    when the step returned)."""
    calls = RecordingCalls()
    route_stores(monkeypatch, calls)
    model = _deep_model("tiny/qwen3")
    batch = make_batch("sft", batch_size=1, seq_len=20, vocab_size=model.config.vocab_size)
    phase_timer = LoggingTimer(calls) if timer else None
    with calls.tracking():
        streamed(
            model, batch.input_ids, objective=batch.objective(), chunk_size=7, logits_chunk_size=9,
            checkpoints=checkpoints, timer=phase_timer,
        )  # fmt: skip
    return calls, phase_timer, calls.default.clock[0]


@pytest.mark.parametrize(
    "checkpoints", ["gpu", "cpu", "recompute:2", "cpu+recompute:4+spill"], ids=lambda p: f"checkpoints={p}"
)
def test_events_lie_on_their_streams_and_the_device_is_synchronised_once(monkeypatch, checkpoints):
    """The stand-in counts a millisecond per op: the compute stream's phases and the rest add up to
    the step's ops, host copies are the side stream's ops, waits are on the compute stream, rebuilds
    only where a placement recomputes; no synchronize inside the step and one when resolved."""
    calls, timer, end = _standin_step(monkeypatch, checkpoints)
    placement = Placement.parse(checkpoints)
    assert calls.synchronizes == 0 and calls.timing_events
    assert calls.host_waits.count("device") == 0
    times = timer.resolve()
    timer.resolve()  # read once: a second call synchronises no more
    assert calls.synchronizes == 1
    calls.assert_clean()  # no elapsed time read before its events were done, none across streams
    seconds = times.seconds
    first = calls.timing_events[0]
    assert first.stream == 0 and times.step_s == (end - first.position) / 1000  # the step's ops, every one
    inside = sum(s for name, s in seconds.items() if name != HOST_COPIES)
    assert inside + times.other_s == pytest.approx(times.step_s, abs=1e-12)
    assert times.other_s > 0  # the embedding's backward, gradient rounding
    assert all(seconds[name] > 0 for name in COMPUTED)
    assert (seconds[REBUILD] > 0) == (placement.recompute_every > 1)
    assert seconds[HOST_COPIES] == pytest.approx(calls.side_ops / 1000)
    assert (seconds[HOST_COPIES] > 0) == placement.offload
    assert times.overlapped == ({HOST_COPIES} if placement.offload else frozenset())
    streams = {name: {where for logged, where in timer.log if logged == name} for name in PHASES}
    assert streams[HOST_COPIES] <= {"side"} and streams[COPY_WAITS] <= {"compute"}
    assert bool(streams[COPY_WAITS]) == placement.offload  # a wait before each layer brought back
    assert all(streams[name] == {"compute"} for name in COMPUTED)
    by_stream = {}
    for event in calls.timing_events:  # recorded in order: each stream's marks never go back
        assert event.position >= by_stream.get(event.stream, 0)
        by_stream[event.stream] = event.position


def test_a_step_without_a_timer_records_no_event(monkeypatch):
    """No timer: no timing event, no synchronize; the cpu placement's store waits as before."""
    calls, _, _ = _standin_step(monkeypatch, "cpu", timer=False)
    assert calls.timing_events == [] and calls.synchronizes == 0
    calls.assert_clean()


def test_times_read_without_the_synchronize_are_caught(monkeypatch):
    """The stand-in catches a timer that reads its events without synchronising (the check has teeth)."""
    calls = RecordingCalls(drop="device_synchronize")
    timer = PhaseTimer(calls)
    with calls.tracking():
        timer.start(torch.device("cpu"))
        with timer.phase("head"):
            torch.ones(3).add_(1)
        timer.finish()
    timer.resolve()
    assert any(v.startswith("timing:") for v in calls.violations)


def test_a_nested_phase_pauses_the_enclosing_one_on_its_stream():
    """Phases on one stream are exclusive: ops of an inner phase count for it alone; a phase on the
    side stream runs beside the compute stream's and stays out of the rest (other_s)."""
    calls = RecordingCalls()
    timer = PhaseTimer(calls)
    side = calls.new_stream(torch.device("cpu"))
    x = torch.ones(4)
    with calls.tracking():
        timer.start(torch.device("cpu"))
        with timer.phase("checkpoint pass"):
            x.add_(1)  # 1 op
            with timer.phase("host copies"):
                x.add_(1)
                x.add_(1)  # 2 ops
            x.add_(1)  # 1 op
            with calls.use_stream(side), timer.phase("host copies", side):
                torch.ones(4)  # 1 op on the side stream
        x.add_(1)  # 1 op outside every phase
        timer.finish()
    times = timer.resolve()
    assert times.seconds["checkpoint pass"] == 2 / 1000
    assert times.seconds["host copies"] == 3 / 1000
    assert times.step_s == 5 / 1000 and times.other_s == 1 / 1000
    calls.assert_clean()


def test_on_a_cpu_the_phases_add_up_to_the_steps_wall_time():
    """A CPU step (perf_counter): phases plus the rest are the timer's step, which is the wall time of
    stream_backward to within its setup; the host copies of the cpu placement, inside the checkpoint
    pass, are not counted twice; every phase the step runs has time."""
    model = tiny_model("tiny/qwen3", torch.float32, num_hidden_layers=3)
    batch = make_batch("sft", batch_size=1, seq_len=64, vocab_size=model.config.vocab_size)
    for checkpoints in ("cpu", "recompute:2"):
        timer = PhaseTimer()
        start = time.perf_counter()
        streamed(
            model, batch.input_ids, objective=batch.objective(), chunk_size=16, logits_chunk_size=32,
            checkpoints=checkpoints, timer=timer,
        )  # fmt: skip
        wall = time.perf_counter() - start
        times = timer.resolve()
        assert times.overlapped == frozenset()
        assert sum(times.seconds.values()) + times.other_s == pytest.approx(times.step_s, rel=1e-9)
        assert times.step_s <= wall and times.step_s > 0.7 * wall
        assert times.other_s < 0.3 * times.step_s
        assert all(times.seconds[name] > 0 for name in COMPUTED)
        assert (times.seconds[HOST_COPIES] > 0) == (checkpoints == "cpu")
        assert (times.seconds[REBUILD] > 0) == (checkpoints == "recompute:2")


def test_the_names_are_flops_phases_and_row_columns():
    """Each phase with FLOPs in measure/flops.py is a core phase, and each core phase (and the rest)
    has its `phase_*_s` column in the results schema."""
    config = tiny_model("tiny/qwen3").config
    flops = phase_flops(config, method="streambp", batch_size=1, seq_len=64, recompute_every=2)
    assert set(flops) <= set(PHASES) and set(flops) >= set(COMPUTED) | {REBUILD}
    columns = {phase_column(name) for name in (*PHASES, "other")}
    assert len(columns) == len(PHASES) + 1 and columns <= set(ResultRow.__dataclass_fields__)
    assert phases.timed(None, "head").__class__.__name__ == "nullcontext"
