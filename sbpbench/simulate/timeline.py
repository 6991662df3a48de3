"""The predicted memory timeline of a point: the estimator's fake-tensor walk of the step, sampled
after every op, in the format of a measured one (measure/timeline/data.py).

The walk is `simulate` (estimate.py) with a counter that also logs: the same phases (the model's
labels and StreamBP's own), the same kinds (methods/memory_marks.py) and the same resident
breakdown as `sbp run --timeline` records, so a measured and a predicted timeline of one point
draw on one figure and compare bucket by bucket. Target cpu reproduces the CPU tracker's
timeline; target cuda predicts a GPU's (512-byte blocks, CUDA kernels' hidden buffers among the
intermediates). A full walk, never extrapolated: a long point costs what `sbp estimate --exact` does.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import RunSpec
from ..measure.timeline.data import Timeline
from ..measure.timeline.tracked import TrackerMarks
from ..methods.memory_marks import marking
from ..workload.timeline import resident_kinds
from .estimate import granularity_bytes, simulate, unrun_step
from .memory_counter import SimulatedMemory


class PredictedTimeline(TrackerMarks, SimulatedMemory):
    """The simulator's counter, logging the live bytes after every op (its hidden buffers included)."""

    def __init__(self, granularity_bytes: int = 1, hidden=None):
        self._start_log()
        super().__init__(granularity_bytes, hidden)
        self.log.phase = self.phase
        self.log.add(0, 0)

    def observe(self, func, live_bytes: int, inside: list[int]) -> None:
        self.ops += 1
        self.log.add(self.ops, live_bytes)

    def attached(self, step):
        """The step's marks, its phases aside: simulate's own PhaseLabels set them (label_phases)."""
        return marking(self, step, label_phases=False)


def predicted_timeline(spec: RunSpec, *, target: str = "cuda") -> Timeline:
    """The point's predicted timeline (module docstring): `at` counts ops, bytes include the resident
    baseline (rounded as the target's allocator rounds), the peak's kinds sum to the peak."""
    spec = replace(spec, device="cpu", warmup=0, repeats=0)  # fake CPU tensors stand for any device
    estimate, recorder = simulate(spec, target=target, counter_type=PredictedTimeline)
    baseline = estimate.baseline_bytes
    kinds = resident_kinds(unrun_step(spec, target), granularity_bytes(target))
    assert sum(kinds.values()) == baseline, "the resident kinds must sum to the baseline"
    for kind, nbytes in recorder.peak_kinds.items():
        kinds[kind] = kinds.get(kind, 0) + nbytes
    timeline = recorder.log.timeline(
        kinds=kinds, offset=baseline, source="simulated", memory_source="fake-tensor", axis="op",
        baseline_bytes=baseline, point={}, end=recorder.ops,
    )  # fmt: skip
    if target == "cuda":
        timeline.notes.append(f"predicted for a GPU (attention kernel modelled: {estimate.attention_kernel or '-'})")
    return timeline
