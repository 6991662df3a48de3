"""An experiment file's points run as one sweep (`sbp sweep`): what is left to run, then running it
under an optional wall-clock budget, each row in `out` before the next point starts.

`plan_experiment` checks the machine and the results file and says what is left; `run_experiment`
runs it and returns an Outcome (outcome.py): the new rows, and whether the budget or Ctrl-C
stopped it. The same command resumes from `out`. `plan_seeds` and `store_seeds` are
`sbp sweep --seeds-only`: every search's seed predicted ahead, on any machine (seeds.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import MaxlenSpec, RunSpec
from ..config.experiment import Experiment
from ..measure.environment import Environment, capture_environment
from ..measure.units import gib
from ..records import ResultRow, check_writable, decode_row, read_rows, row_key
from .budget import BudgetSpent, NotStarted
from .outcome import Outcome, Steps, point_line, seq_bound
from .sweep import Job, plan, run_sweep

RESULTS = Path("results")  # where a GPU's measured rows are, whose rates price a point (pricing.py)


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
    out = out or RESULTS / f"{loaded.name}.csv"
    check_writable(out)
    first = (loaded.grid or [s.base for s in loaded.searches])[0]
    env = capture_environment(first.device)
    return SweepPlan(loaded.name, out, env, plan(loaded.points, out, device_name=env.device_name, resume=resume))


def run_experiment(
    sweep: SweepPlan,
    *,
    steps: Steps,
    budget_s: float | None = None,
    budget: str = "",
    cost: Callable[[RunSpec], float] | None = None,
) -> Outcome:
    """Run what is left; a max-length search starts at its predicted max T (stored in `out`, else
    predicted and stored there) unless the file says seed_from_estimate = false. budget: budget_s as
    the user gave it, for the line that says it ran out. cost: spec -> its predicted seconds
    (default: on a GPU, pricing.py `point_seconds`); under the budget a point predicted not to
    finish in what is left is not started, and the sweep goes on with the next."""
    from .budget import Budget, within  # looked up at the call: tests stand in a clock of their own
    from .isolated import run_isolated
    from .pricing import point_seconds
    from .simulated_search import estimate_seed

    todo, outcome, current, deferred = sweep.todo, Outcome(), [], []
    clock = Budget(budget_s) if budget_s is not None else None
    if clock is not None and cost is None and sweep.env.device.startswith("cuda"):
        cost = point_seconds(sweep.env.device_name, RESULTS)

    def start(job: Job) -> None:
        current[:] = [job]
        steps.start(job.describe())

    def done(job: Job, row: ResultRow) -> None:
        outcome.rows.append(row)
        steps.advance(f"{job.describe()}: {_ended(row)}")

    def probed(job: Job, row: ResultRow) -> None:
        outcome.probes.append(row)
        steps.note(f"{job.describe()}: probe {point_line(row)}")

    def seeded(row: ResultRow, stored: bool) -> None:
        if not stored:
            outcome.seeds.append(row)

    def put_off(job: Job, why: NotStarted) -> None:
        deferred.append(job)
        steps.advance(f"{job.describe()}: not started ({why}); the next command runs it")

    try:
        seed = estimate_seed(
            capacity_bytes=sweep.env.device_total_memory_bytes,
            budget=clock,
            note=steps.note,
            out=sweep.out,
            on_row=seeded,
        )
        run_sweep(
            todo, sweep.out, env=sweep.env, seed=seed, on_start=start, on_done=done, on_deferred=put_off,
            measure=within(run_isolated, clock, cost=cost) if clock else run_isolated,
            on_probe=probed,
        )  # fmt: skip
    except BudgetSpent as spent:
        left = len(todo) - todo.index(current[0]) + len(deferred)
        outcome.stopped = (
            f"--budget {budget} spent at {current[0].describe()} ({spent}): {left} of {len(todo)} point(s) left; "
            f"finished points are in {sweep.out}; run the same command to resume"
        )
    except KeyboardInterrupt:
        outcome.interrupted = f"interrupted: finished points are in {sweep.out}; run the same command to resume"
    else:
        if deferred:
            outcome.stopped = (
                f"--budget {budget}: {len(deferred)} of {len(todo)} point(s) not started, each predicted to need "
                f"more than was left (first: {deferred[0].describe()}); finished points are in {sweep.out}; "
                "run the same command to resume"
            )
    return outcome


@dataclass(frozen=True)
class SeedPlan:
    """`sbp sweep --seeds-only`: the searches left to seed, and the GPU their seeds are for."""

    name: str
    out: Path
    gpu: str  # the GPU's name ("": none known; each search's memory limit is then its memory)
    capacity_bytes: int | None  # its memory (None: unknown)
    searches: list[MaxlenSpec]  # seeded searches not yet answered in `out`
    answered: int  # searches `out` already answers (for this GPU): no seed needed

    def header(self) -> str:
        target = f"{self.gpu} ({gib(self.capacity_bytes)} GiB)" if self.capacity_bytes else "a GPU of its memory_limit"
        return (
            f"{self.name}: {len(self.searches)} search(es) to seed, {self.answered} already answered in {self.out}; "
            f"each seed predicted on this machine's CPU for {target}"
        )


def check_seeds_device(device: str | None) -> None:
    """--seeds-only predicts a GPU's seeds: on this machine's GPU, or with no device given (any machine)."""
    from ..config.device import device_kind, resolve_device

    if device is not None and device_kind(resolve_device(device)) != "cuda":
        raise ValueError(f"--seeds-only predicts a GPU sweep's seeds: leave out --device {device}")


def plan_seeds(path: Path, out: Path | None, *, results: Path, device: str | None, resume: bool) -> SeedPlan:
    """The seeds `sbp sweep --seeds-only` would store: for this machine's GPU, else the GPU with
    most measured rows under `results` (as --dry-run prices), else each search's memory limit. A
    search with no limit and no GPU memory known is an error before any work."""
    from ..config.device import device_kind, resolve_device
    from ..config.experiment import load_experiment
    from ..simulate.cost import measured_capacity, measured_gpu
    from .seeds import seed_memory
    from .simulated_search import is_seeded

    resolved = resolve_device(device or "auto")
    if device_kind(resolved) == "cuda":
        env = capture_environment(resolved)
        gpu, capacity = env.device_name, env.device_total_memory_bytes
        loaded = load_experiment(path, device=device)
    elif device is not None:
        check_seeds_device(device)
    else:
        gpu = measured_gpu(results) or ""
        capacity = measured_capacity(results, gpu) if gpu else None
        loaded = load_experiment(path, device="cpu", defaults_for="cuda")  # a GPU's searches, on any machine
    out = out or RESULTS / f"{loaded.name}.csv"
    check_writable(out)
    planned = plan(loaded.points, out, device_name=gpu, resume=resume)
    jobs = [job for job in planned if isinstance(job.point, MaxlenSpec)]
    searches = [job.point for job in jobs if not job.done and is_seeded(job.point)]
    for search in searches:
        if seed_memory(search, capacity, "cuda") is None:
            raise ValueError(
                f"{search.base.model} {search.method}: no memory_limit and no GPU's memory known here; "
                "set memory_limit in the file, or run --seeds-only on the GPU"
            )
    return SeedPlan(loaded.name, out, gpu, capacity, searches, sum(job.done for job in jobs))


def store_seeds(seeds: SeedPlan, *, steps: Steps, budget_s: float | None = None, budget: str = "") -> Outcome:
    """Each search's seed, read from `out` if stored there, else predicted and stored; the outcome's
    rows are the seeds predicted now (a failed prediction is an error row, and the next run predicts
    it again)."""
    from .budget import Budget  # looked up at the call: tests stand in a clock of their own
    from .simulated_search import estimate_seed

    outcome, lines = Outcome(), []
    clock = Budget(budget_s) if budget_s is not None else None

    def kept(row: ResultRow, stored: bool) -> None:
        if not stored:
            outcome.rows.append(row)

    seed = estimate_seed(
        capacity_bytes=seeds.capacity_bytes, budget=clock, note=lines.append, out=seeds.out, target="cuda", on_row=kept
    )
    for number, search in enumerate(seeds.searches):
        steps.start(f"seed: {search.base.model}, {search.method}")
        try:
            seed(search)
        except BudgetSpent as spent:
            outcome.stopped = (
                f"--budget {budget} spent at {search.base.model} {search.method}'s seed ({spent}): "
                f"{len(seeds.searches) - number} of {len(seeds.searches)} seed(s) left; run the same command to resume"
            )
            break
        except KeyboardInterrupt:
            outcome.interrupted = f"interrupted: the seeds so far are in {seeds.out}; run the same command to resume"
            break
        steps.advance(f"{search.base.model}, {lines[-1]}")
    return outcome


def _ended(row: ResultRow) -> str:
    """How a point or a search ended, in a few words."""
    if row.kind == "maxlen":
        return f"max T {seq_bound(row)}" if row.status == "ok" else row.status + (f": {row.error}" if row.error else "")
    return point_line(row).split(": ", 1)[1]
