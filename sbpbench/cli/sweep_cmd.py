"""`sbp sweep`: run an experiment file point by point, with progress, resumable."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..records import ResultRow
from ..runner.outcome import written_line
from .errors import user_errors
from .options import BudgetOpt, out_option, point_command, say_ignored
from .outcomes import finish
from .progress import Progress
from .run_cmd import warn_if_busy, warn_if_loaded
from .tables import maxlen_table, points_table, print_table

SweepOutOpt = out_option("results/<experiment name>.csv")
DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Run nothing: list the entries left and their predicted GPU time, priced from the GPU rows "
        "under results/ (this machine's GPU, else the one with most rows).",
    ),
]
SeedsOnlyOpt = Annotated[
    bool,
    typer.Option(
        "--seeds-only",
        help="Run nothing on a device: predict each max-length search's seed (its predicted max T) on this "
        "machine's CPU, for the GPU --dry-run prices, and store it in --out, where the sweep reads it.",
    ),
]

EXAMPLES = (  # the end of its help (options.py examples)
    "sbp sweep experiments/smoke_cpu.toml    # memory, time and max T on a CPU",
    "sbp sweep experiments/paper_table1.toml --no-resume   # measure again",
    "sbp sweep experiments/paper_fig3.toml --budget 9m   # exit 3: rerun resumes",
)


@point_command(
    ("device", "threads"),
    helps={
        "device": "Override every point's device (cpu, cuda, cuda:N).",
        "threads": "Override every point's CPU threads (default: the file's, else OMP_NUM_THREADS, else the physical cores available).",
    },
)
def sweep(
    settings: dict,
    methods: tuple[str, ...],
    experiment: Annotated[
        Path, typer.Argument(metavar="EXPERIMENT", help="Experiment file, e.g. experiments/smoke_cpu.toml.")
    ],
    out: SweepOutOpt = None,
    resume: Annotated[
        bool, typer.Option(help="Skip points already in --out (same settings); --no-resume reruns them.")
    ] = True,
    budget: BudgetOpt = None,
    dry_run: DryRunOpt = False,
    seeds_only: SeedsOnlyOpt = False,
) -> None:
    """Run every point of an experiment file, resumable.

    Each point runs in its own process, with a progress bar, and is in --out before the next
    starts: Ctrl-C or a kill loses at most the point in flight, and the same command resumes. An
    OOM is recorded and the sweep goes on; longer sequences of the same settings are then
    recorded as skipped (certain OOM). A search stopped by a failed probe is recorded as an error
    and the sweep goes on. Under --budget on a GPU, a point the cost model predicts will not finish
    in what is left is not started; the next command runs it."""
    from ..config.experiment import ignored_keys, load_experiment
    from ..measure.units import parse_seconds
    from ..runner.experiment import plan_experiment, run_experiment

    with user_errors():
        if dry_run and seeds_only:
            raise ValueError("--dry-run and --seeds-only: give one of them")
        seconds = parse_seconds(budget) if budget is not None else None
        _check_seeds_wanted(experiment, settings.get("device"), seeds_only)  # before the notices: one line
    say_ignored(ignored_keys(experiment), names={}, where=f"{experiment}: ")  # the file's keys, as written
    if dry_run:
        _dry_run(experiment, out, settings.get("device"))
        return
    if seeds_only:
        _seeds_only(experiment, out, settings.get("device"), resume=resume, seconds=seconds, budget=budget or "")
        return
    with user_errors():
        loaded = load_experiment(experiment, device=settings.get("device"), threads=settings.get("threads"))
        sweep = plan_experiment(loaded, out, resume=resume)
    console = Console()
    console.print(sweep.header(), highlight=False)
    warn_if_busy()
    with user_errors(), Progress(console, len(sweep.todo)) as progress:  # a failed write says where rows are
        outcome = run_experiment(sweep, steps=progress, budget_s=seconds, budget=budget or "")
    if not outcome.interrupted and not outcome.failed:
        _summary(console, loaded.name, sweep.rows())
        console.print(written_line(outcome, sweep.out), highlight=False, soft_wrap=True)
    finish(console, outcome)


def _check_seeds_wanted(experiment: Path, device: str | None, seeds_only: bool) -> None:
    """--seeds-only's checks: a --device that predicts GPU seeds (runner/experiment.py), and without
    one, a file whose searches all run on the CPU refused: it would store GPU seeds that no run of
    the file reads, since a CPU sweep predicts its own seeds as it runs (runner/seeds.py)."""
    from ..config import MaxlenSpec
    from ..config.experiment import load_experiment
    from ..runner.experiment import check_seeds_device

    check_seeds_device(device if seeds_only else None)
    if not seeds_only or device is not None:
        return

    with warnings.catch_warnings():  # plan_seeds loads the file again and says its warnings once
        warnings.simplefilter("ignore")
        loaded = load_experiment(experiment, device="cpu", defaults_for="cuda")  # any machine: devices as named
    named = [device for point, device in zip(loaded.points, loaded.devices) if isinstance(point, MaxlenSpec)]
    if named and all(device == "cpu" for device in named):
        raise ValueError(
            f"{experiment} runs its searches on the CPU, and a CPU sweep predicts their seeds as it runs: "
            "--seeds-only predicts a GPU sweep's; give --device cuda on a GPU to predict them"
        )


def _seeds_only(
    experiment: Path, out: Path | None, device: str | None, *, resume: bool, seconds: float | None, budget: str
) -> None:
    """Predict and store each search's seed (runner/seeds.py), one line each."""
    from ..runner.experiment import plan_seeds, store_seeds

    with user_errors():
        seeds = plan_seeds(experiment, out, results=Path("results"), device=device, resume=resume)
    console = Console()
    console.print(seeds.header(), highlight=False, soft_wrap=True)
    with user_errors(), Progress(console, len(seeds.searches)) as progress:
        outcome = store_seeds(seeds, steps=progress, budget_s=seconds, budget=budget)
    if not outcome.interrupted:
        console.print(written_line(outcome, seeds.out), highlight=False, soft_wrap=True)
    finish(console, outcome)


def _dry_run(experiment: Path, out: Path | None, device: str | None) -> None:
    """Print what `sbp sweep` would still run, entry by entry, with its predicted device time (none
    for an experiment that runs on the CPU)."""
    from ..config.device import device_kind, resolve_device
    from ..measure.environment import capture_environment
    from ..records.reference import load_reference
    from ..runner.budget import MIN_START_S
    from ..runner.pricing import price_experiment
    from ..simulate.cost import commands, groups

    with user_errors():
        resolved = resolve_device(device or "auto")
        env = capture_environment(resolved) if device_kind(resolved) == "cuda" else None
        results = Path("results")
        pricing = price_experiment(
            experiment,
            results=results,
            out=out or results,
            gpu=env.device_name if env else None,
            capacity_bytes=env.device_total_memory_bytes if env else None,
            reference=load_reference(),
            device=device,
        )
    console = Console()
    where = out or results / f"{pricing.name}.csv"
    if pricing.rates is None:
        _unpriced(console, pricing, where)
        return
    table = Table(title=f"{pricing.name}: {len(pricing.costs)} point(s) to run, {pricing.done} already in {where}")
    for column in ("entry", "points", "device min", "host min", "command"):
        table.add_column(column, justify="left" if column == "entry" else "right")
    for group in groups(pricing):
        span = group["commands"]
        device_min = "?" if group["device_s"] != group["device_s"] else f"{group['device_s'] / 60:.1f}"
        table.add_row(group["title"] or "(untitled)", str(group["points"]), device_min, f"{group['host_s'] / 60:.1f}",
                      str(span[0]) if len(span) == 1 else f"{span[0]}-{span[-1]}")  # fmt: skip
    count = max(commands(pricing.costs, min_start_s=MIN_START_S), default=0)
    table.caption = (
        f"Predicted for {pricing.device}, not measured: {count} command(s) of 9 minutes each (--budget 9m). device min: process "
        "starts and steps on the GPU; host min: the seeds' fake-tensor searches on the CPU, none for a seed "
        "stored by --seeds-only. "
        f"Rates: {pricing.rates.describe()}"
    )
    print_table(console, table)


def _unpriced(console: Console, pricing, where: Path) -> None:
    """A CPU experiment's entries left, with no predicted time (simulate/cost.py CPU_NOT_PRICED)."""
    from ..runner.budget import MIN_START_S
    from ..simulate.cost import CPU_NOT_PRICED, groups

    title = f"{pricing.name}: {len(pricing.costs)} point(s) to run on the CPU, {pricing.done} already in {where}"
    table = Table(title=title)
    table.add_column("entry")
    table.add_column("points", justify="right")
    for group in groups(pricing):
        table.add_row(group["title"] or "(untitled)", str(group["points"]))
    table.caption = (
        f"No time predicted for the CPU ({pricing.device}): {CPU_NOT_PRICED}. Under --budget each point "
        f"starts while {MIN_START_S:.0f} s are left."
    )
    print_table(console, table)


def _summary(console: Console, name: str, rows: list[ResultRow]) -> None:
    points = [row for row in rows if row.kind == "point"]
    if points:
        models = sorted({row.model for row in points})
        title = f"{name}: every point" + (f" ({models[0]})" if len(models) == 1 else "")
        print_table(console, points_table(title, points))
        warn_if_loaded(console, points)
    searches: dict[tuple, list[ResultRow]] = {}
    for row in rows:
        if row.kind == "maxlen":
            group = (row.model, row.objective, row.lora_rank, row.step, row.dtype, row.batch_size)
            searches.setdefault(group, []).append(row)
    for group_rows in searches.values():
        print_table(console, maxlen_table(group_rows))
