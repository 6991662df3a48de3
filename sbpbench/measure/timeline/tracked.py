"""A step's memory timeline on the CPU: the live-tensor tracker, sampled after every op.

`TrackedTimeline` is a LiveTensorTracker (measure/tensor_tracker.py) that also logs the allocated bytes
(the resident baseline plus the tracked live bytes) after each op, the op's count as the time axis.
Deterministic like the tracker, so its shape, its peak (the row's peak, to the byte) and its
breakdown may be asserted. The runner marks it (phases, kinds, the host) as it marks any recorder.
"""

from __future__ import annotations

from ..tensor_tracker import LiveTensorTracker
from .data import Timeline
from .log import TimelineLog
from .marks import PhaseMarks


class TrackerMarks(PhaseMarks):
    """PhaseMarks of a tracker that logs per op (this one, and the estimator's, simulate/timeline.py):
    the op count is the time, the phase and the host go to its log, the kind to the tracker."""

    def _start_log(self) -> None:
        self.log = TimelineLog()
        self._start_marks()
        self.ops = 0

    def _now(self) -> int:
        return self.ops

    def _mark(self, name: str, kind: str) -> None:
        self.log.phase = name
        self.set_phase_kind(kind)

    def _host_sample(self, at: int, pinned: int | None, rss: int | None) -> None:
        self.log.host_sample(at, pinned, rss)


class TrackedTimeline(TrackerMarks, LiveTensorTracker):
    """with TrackedTimeline(resident_kinds) as recorder: step(); recorder.timeline().

    resident_kinds: the bytes resident before the step by kind (weights, gradients, ...): the baseline."""

    def __init__(self, resident_kinds: dict[str, int], *, limit_bytes: int | None = None, granularity_bytes: int = 1):
        self._start_log()
        super().__init__(granularity_bytes=granularity_bytes, limit_bytes=limit_bytes)
        self.resident_kinds = dict(resident_kinds)
        self.baseline_bytes = baseline_bytes = sum(resident_kinds.values())
        self.log.phase = self.phase
        self.log.add(0, baseline_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:  # an op over the limit raised after counting: its bytes are the timeline's last
            self.ops += 1
            self.log.add(self.ops, self.baseline_bytes + self.live_bytes)

    def timeline(self, **fields) -> Timeline:
        kinds = dict(self.resident_kinds)
        for kind, nbytes in self.peak_kinds.items():
            kinds[kind] = kinds.get(kind, 0) + nbytes
        return self.log.timeline(
            kinds=kinds, source="measured", memory_source="tensor-tracker", axis="op",
            baseline_bytes=self.baseline_bytes, **fields,
        )  # fmt: skip
