"""An experiment file's points run as one sweep (`sbp sweep`): what is left to run, then running it
under an optional wall-clock budget, each row in `out` before the next point starts.

`plan_experiment` checks the machine and the results file and says what is left; `run_experiment`
runs it and returns an Outcome (outcome.py): the new rows, and whether the budget, a failed probe
or Ctrl-C stopped it. The same command resumes from `out`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config.experiment import Experiment
from ..measure.environment import Environment, capture_environment
from ..records import ResultRow, check_writable, decode_row, read_rows, row_key
from .budget import BudgetSpent
from .maxlen import ProbeFailed
from .outcome import Outcome, Steps, point_line, seq_bound
from .sweep import Job, plan, run_sweep


@dataclass(frozen=True)
class SweepPlan:
    name: str
    out: Path
    env: Environment  # the machine the points run on
    jobs: list[Job]  # every point of the file, those already in `out` marked done

    @property
    def todo(self) -> list[Job]:
        return [job for job in self.jobs if not job.done]

    def header(self) -> str:
        done = len(self.jobs) - len(self.todo)
        return (
            f"{self.name}: {len(self.jobs)} point(s), {done} already in {self.out}, {len(self.todo)} to run on "
            f"{self.env.device_name}"
        )

    def rows(self) -> list[ResultRow]:
        """The rows of this experiment's points now in `out` (earlier runs' included)."""
        keys = {job.key for job in self.jobs}
        return [decode_row(row) for row in read_rows(self.out) if row_key(row) in keys]


def plan_experiment(loaded: Experiment, out: Path | None, *, resume: bool) -> SweepPlan:
    """What is left of the experiment (resume: skip the points already in `out`), after checking
    that this machine can measure its points and that `out` can be written."""
    from ..config.run import check_measurable

    check_measurable([*loaded.grid, *(s.base for s in loaded.searches)])
    out = out or Path("results") / f"{loaded.name}.csv"
    check_writable(out)
    first = (loaded.grid or [s.base for s in loaded.searches])[0]
    env = capture_environment(first.device)
    return SweepPlan(loaded.name, out, env, plan(loaded.points, out, device_name=env.device_name, resume=resume))


def run_experiment(sweep: SweepPlan, *, steps: Steps, budget_s: float | None = None, budget: str = "") -> Outcome:
    """Run what is left; a max-length search starts at its predicted max T unless the file says
    seed_from_estimate = false. budget: budget_s as the user gave it, for the line that says it ran out."""
    from .budget import Budget, within  # looked up at the call: tests stand in a clock of their own
    from .isolated import run_isolated
    from .simulated_search import estimate_seed

    todo, outcome, current = sweep.todo, Outcome(), []
    clock = Budget(budget_s) if budget_s is not None else None

    def start(job: Job) -> None:
        current[:] = [job]
        steps.start(job.describe())

    def done(job: Job, row: ResultRow) -> None:
        outcome.rows.append(row)
        steps.advance(f"{job.describe()}: {_ended(row)}")

    def probed(job: Job, row: ResultRow) -> None:
        outcome.probes.append(row)
        steps.note(f"{job.describe()}: probe {point_line(row)}")

    try:
        seed = estimate_seed(capacity_bytes=sweep.env.device_total_memory_bytes, budget=clock, note=steps.note)
        run_sweep(
            todo, sweep.out, env=sweep.env, seed=seed, on_start=start, on_done=done,
            measure=within(run_isolated, clock) if clock else run_isolated,
            on_probe=probed,
        )  # fmt: skip
    except BudgetSpent as spent:
        left = len(todo) - todo.index(current[0])
        outcome.stopped = (
            f"--budget {budget} spent at {current[0].describe()} ({spent}): {left} of {len(todo)} point(s) left; "
            f"finished points are in {sweep.out}; run the same command to resume"
        )
    except KeyboardInterrupt:
        outcome.interrupted = f"interrupted: finished points are in {sweep.out}; run the same command to resume"
    except ProbeFailed as error:
        outcome.failed = f"{error}; finished points are in {sweep.out}"
    return outcome


def _ended(row: ResultRow) -> str:
    """How a point or a search ended, in a few words."""
    if row.kind == "maxlen":
        return f"max T {seq_bound(row)}" if row.status == "ok" else row.status + (f": {row.error}" if row.error else "")
    return point_line(row).split(": ", 1)[1]
