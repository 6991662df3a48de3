"""A wall-clock budget for `sbp sweep` and `sbp maxlen` (--budget): the time the user gives the
command, so that it stops cleanly before a limit of theirs would kill it (a scheduler's limit on a
job, a shell's timeout).

A point's own timeout (timeout.py) starts at 10 minutes of set-up allowance, so under a shorter
limit on the command, that limit, not the point's timeout, would end a long point: killed mid-point,
with the summary and whatever ran after it in the same command lost. Under a budget a point starts only
while at least MIN_START_S are left, and runs under the smaller of its own timeout and what is
left. A point cut by the budget is not a result (it says nothing about the machine): its row is
dropped, BudgetSpent stops the command, and the same command resumes (every finished point and
probe is already in the CSV). Given a cost model, a point predicted to need more than is left is
not started at all (NotStarted): a sweep goes on with the points that fit, and a later command
runs it.

A max-length search's seed (a prediction on this machine's CPU, seconds a probe) runs under the
same budget before the search's first probe: each predicted probe starts only while a measured
point still could (`started_within`); none is cut, as a prediction has no timeout to shorten."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..config import RunSpec
from ..measure.environment import Environment
from ..records import ResultRow
from .timeout import point_timeout_s

# A point left less than this is not started: a process start, imports and building the model
# take tens of seconds on a GPU before its first step (selftest.py's POINT_OVERHEAD_S: 30 measured).
MIN_START_S = 30.0

Measure = Callable[[RunSpec, Environment], ResultRow]


class BudgetSpent(Exception):
    """The budget ran out: the point named was not started, or was cut (no row kept)."""


class NotStarted(BudgetSpent):
    """A point predicted to need more than the budget has left: not started, so nothing is lost."""


@dataclass
class Budget:
    seconds: float
    clock: Callable[[], float] = time.monotonic
    deadline: float = field(init=False)

    def __post_init__(self):
        self.deadline = self.clock() + self.seconds

    def left(self) -> float:
        return self.deadline - self.clock()


def within(
    measure: Measure,
    budget: Budget,
    *,
    min_start_s: float = MIN_START_S,
    cost: Callable[[RunSpec], float] | None = None,
) -> Measure:
    """`measure` run under `budget`: BudgetSpent instead of a point that would not start in time
    or was cut by it, NotStarted instead of one that `cost` (the point's predicted seconds, NaN:
    unknown) says will not finish in what is left; every other row, a timeout under the point's
    own limit included, as it is."""

    def measured(spec: RunSpec, env: Environment) -> ResultRow:
        left = budget.left()
        if left < min_start_s:
            raise BudgetSpent(f"not started: {left:.0f} s left, a point needs at least {min_start_s:g}")
        need = cost(spec) if cost is not None else math.nan
        if need > left:
            raise NotStarted(f"predicted to need {need:.0f} s, {left:.0f} s left")
        own = point_timeout_s(spec)
        if own <= left:
            return measure(spec, env)
        cut = float(math.floor(left))
        row = measure(replace(spec, timeout_s=cut), env)
        if row.status == "timeout":
            raise BudgetSpent(f"cut after {cut:g} s (its own limit: {own:g} s); not recorded")
        return row  # its timeout_s is the cut it ran under

    return measured


def started_within(work: Callable, budget: Budget, *, what: str, min_start_s: float = MIN_START_S) -> Callable:
    """`work` (any call), raising BudgetSpent instead of starting once less than min_start_s is left."""

    def started(*args, **kwargs):
        left = budget.left()
        if left < min_start_s:
            raise BudgetSpent(f"{what} not started: {left:.0f} s left, a point needs at least {min_start_s:g}")
        return work(*args, **kwargs)

    return started
