"""Wall time of a step: warm-up discarded, the device synchronised around each timed step, the
median and spread of `repeats` steps (never a lone mean). The median of an even count is its lower
middle, a time one step took: the step whose phases a row reports (runner/point.py) is that step. Python's cyclic garbage collector is
paused inside the timed region, as `timeit` does: a full collection over transformers' objects
takes a few hundred milliseconds and would land on whichever step triggered it."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TimingStats:
    times_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        """The middle time; of an even count the lower middle (one step's own time, never a mean)."""
        return statistics.median_low(self.times_s)

    @property
    def min_s(self) -> float:
        return min(self.times_s)

    @property
    def max_s(self) -> float:
        return max(self.times_s)


def time_steps(
    step: Callable[[], object],
    *,
    repeats: int,
    synchronize: Callable[[], None] = lambda: None,
    before_each: Callable[[], None] = lambda: None,
) -> TimingStats:
    """Time `repeats` calls of step(). before_each (e.g. zeroing gradients) runs outside the timed
    region; synchronize (torch.cuda.synchronize on a GPU) runs before the clock starts and before
    it stops, so queued kernels are neither charged to the step nor missed by it."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    times = []
    for _ in range(repeats):
        before_each()
        gc.collect()
        synchronize()
        gc.disable()
        try:
            start = time.perf_counter()
            step()
            synchronize()
            times.append(time.perf_counter() - start)
        finally:
            gc.enable()
    return TimingStats(tuple(times))
