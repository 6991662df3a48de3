"""Progress of a long step, for a person watching: "layer i of L" lines once a step is slow.

A Qwen3-8B StreamBP step at T=110k takes minutes; without a sign of life it is
indistinguishable from a hang. `StepProgress` is the per-layer callback of
core/stream.py (`progress(done, num_layers)`): silent for the first `after_s` seconds of a step
(a normal point prints nothing), then one line per layer with the elapsed time. A point runs
several steps (warm-up, the memory step, timed steps); each line names its step. On a GPU the
host runs ahead of the device, so once past `after_s` it synchronises before reading the clock
(a sync per layer is nothing against a multi-second step).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

PROGRESS_AFTER_S = 5.0  # below this a step is quick enough to need no sign of life
PROGRESS_PREFIX = "sbp progress:"  # the parent forwards stderr lines that start with it


class StepProgress:
    """progress = StepProgress("streambp T=110000"); progress.restart("timed step 1 of 3") before
    each step."""

    def __init__(
        self,
        label: str,
        *,
        after_s: float = PROGRESS_AFTER_S,
        synchronize: Callable[[], None] = lambda: None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.label, self.after_s, self.synchronize, self.clock = label, after_s, synchronize, clock
        self.stream = stream
        self.start = clock()
        self.step = ""

    def restart(self, step: str) -> None:
        """A step starts: `step` says which (warm-up 1 of 1, memory step, timed step 2 of 3)."""
        self.start, self.step = self.clock(), step

    def __call__(self, done: int, num_layers: int) -> None:
        if self.clock() - self.start < self.after_s:
            return
        self.synchronize()
        elapsed = self.clock() - self.start
        what = "checkpoint pass and head done" if done == 0 else f"layer {done} of {num_layers} backward done"
        line = f"{PROGRESS_PREFIX} {self.label}: {self.step}, {what}, {elapsed:.1f} s"
        print(line, file=self.stream or sys.stderr, flush=True)
