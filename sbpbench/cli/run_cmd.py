"""`sbp run`: measure peak memory and time of each method at one point, one process per method."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ..measure.threads import busy_warning
from ..records import ResultRow, check_writable, keeps_earlier, read_rows, row_key
from ..runner.outcome import point_line
from ..settings import ConfigError, ignored_knobs
from .errors import user_errors
from .options import RUN_FIELDS, OutOpt, point_command, say_ignored
from .outcomes import fail_if, interrupted
from .progress import Progress
from .tables import load_warning, point_title, print_table, results_table

if TYPE_CHECKING:
    from ..config import RunSpec

DEFAULT_OUT = Path("results/runs.csv")

EXAMPLES = (  # the end of its help (options.py examples)
    "sbp run --device cpu --model tiny/qwen3 --seq 256      # a quick CPU check",
    "sbp run --seq 20000 --method streambp --memory-limit 80GiB --phases",
    "sbp run --objective grpo --lora-rank 32 --step train --out results/mine.csv",
)


# the methods whose step times its phases (methods/streambp.py timing_phases); another's row has none
PHASES_READ_BY = ("streambp",)
PhasesOpt = Annotated[
    bool, typer.Option("--phases", help=f"Also show where {' and '.join(PHASES_READ_BY)}'s step time went.")
]
TimelineOpt = Annotated[bool, typer.Option("--timeline", help="Also save each step's memory over time.")]
TraceOpt = Annotated[
    bool,
    typer.Option(
        "--trace", help="Also save a profiler trace of one extra step after the timed ones (none with --repeats 0)."
    ),
]


@point_command(RUN_FIELDS)
def run(
    settings: dict,
    methods: tuple[str, ...],
    out: OutOpt = None,
    phases: PhasesOpt = False,
    timeline: TimelineOpt = False,
    trace: TraceOpt = False,
) -> None:
    """Measure each method's peak memory and step time at one point.

    One process per method; rows go to a CSV (default: results/runs.csv), replacing the same
    point's. With no options: a GPU comparison (Qwen/Qwen3-4B, T=9000, bf16), or about a minute
    on a CPU (small/qwen3, T=2048, fp32)."""
    from ..config import point_specs
    from ..config.run import check_measurable

    out = out or DEFAULT_OUT
    with user_errors():
        specs = point_specs(settings, methods)
        check_measurable(specs)
        if timeline:
            check_one_process(specs, "--timeline")
        if trace:
            check_one_process(specs, "--trace")
        check_writable(out)
        check_recording_folders(out, timeline, trace and any(spec.repeats for spec in specs))
        earlier = {row_key(row): row for row in read_rows(out)}  # to say what this run replaces
    given = [*settings, *(["--phases"] if phases else [])]
    say_ignored(ignored_knobs([spec.method for spec in specs], given, readers={"--phases": PHASES_READ_BY}))
    console = Console()
    warn_if_busy()
    rows = _measure_all(console, specs, out, timeline, trace)
    title, notes = _results_title(rows)
    print_table(console, results_table(rows, title, notes))
    warn_if_loaded(console, rows)
    if phases:
        print_phases(console, rows)
    if timeline:
        print_timelines(console, specs, rows, out)
    if trace:
        print_traces(console, specs, rows, out)
    for row in rows:
        if row.error:
            console.print(escape(f"{row.method}: {row.status}: {row.error}"), highlight=False, soft_wrap=True)
    console.print(written_line(rows, earlier, out), highlight=False, soft_wrap=True)
    fail_if(any(row.status in ("error", "timeout") for row in rows))


def _measure_all(console: Console, specs: list[RunSpec], out: Path, timeline: bool, trace: bool) -> list[ResultRow]:
    """Each spec measured in its own process, with a progress line per point; Ctrl-C says what was kept."""
    from ..runner import run_points

    rows: list[ResultRow] = []
    try:
        # user_errors: a write that fails after a point was measured says where its row was kept
        with user_errors(), Progress(console, len(specs)) as progress:
            progress.start(_measuring(specs[0]))
            recordings = {name: True for name, wanted in (("timeline", timeline), ("trace", trace)) if wanted}
            points = run_points(specs, out, **recordings)
            for row in points:  # one environment capture for all points
                rows.append(row)
                progress.advance(point_line(row))
                if len(rows) < len(specs):
                    progress.start(_measuring(specs[len(rows)]))
    except KeyboardInterrupt:
        interrupted(console, interrupted_line(rows, specs, out))
    return rows


def _results_title(rows: list[ResultRow]) -> tuple[str, list[str]]:
    """The results table's title (the point, its cap, the device) and its notes."""
    first = rows[0]
    limit = f", limit {first.memory_limit_bytes / 2**30:.2f} GiB" if first.memory_limit_bytes else ""
    effective = first.memory_limit_effective_bytes
    if limit and effective and effective != first.memory_limit_bytes:  # a cap above the device ran at its capacity
        limit += f" (ran at {effective / 2**30:.2f})"
    threads = f", {first.num_threads} thread(s)" if first.num_threads else ""
    point, notes = point_title(rows)
    return f"{point}{limit}\n{first.device_name} ({first.memory_source}{threads})", notes


def print_phases(console: Console, rows: list[ResultRow]) -> None:
    """A phase table per streambp row that has phase times (cli/phase_table.py), or why there is none."""
    from .phase_table import has_phases, phase_table

    timed = [row for row in rows if has_phases(row)]
    for row in timed:
        print_table(console, phase_table(row))
    if not timed:
        console.print("no phase times: they come with streambp points that ran timed steps (--repeats 1 or more)")


def check_one_process(specs: list[RunSpec], flag: str) -> None:
    """A timeline or a trace records one process's step: refuse several ranks before anything runs."""
    if specs[0].nproc > 1:
        raise ConfigError("nproc", f"{{field}} {specs[0].nproc}: {flag} records one process's step; give --nproc 1")


def check_recording_folders(out: Path, timeline: bool, trace: bool) -> None:
    """The folders beside `out` that --timeline and --trace (of a point with timed steps) write into,
    made now: one that cannot be is one line before any point runs, not a point without its recording."""
    import os

    from ..runner.timelines import timeline_dir
    from ..runner.traces import trace_dir

    for flag, wanted, folder in (("--timeline", timeline, timeline_dir(out)), ("--trace", trace, trace_dir(out))):
        if not wanted:
            continue
        if folder.exists() and not folder.is_dir():
            raise ValueError(
                f"{flag} writes into {folder}, which is a file: move it aside, or pass --out in another folder"
            )
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(
                f"{flag} writes into {folder}, which cannot be made ({error.strerror or error}): "
                "pass --out in another folder"
            ) from None
        if not os.access(folder, os.W_OK):
            raise PermissionError(f"{flag} writes into {folder}: no write permission; pass --out in another folder")


def print_timelines(console: Console, specs: list[RunSpec], rows: list[ResultRow], out: Path) -> None:
    """Per row with a timeline: its prediction saved beside it, and the peak's breakdown beside the
    prediction's (cli/timeline_table.py)."""
    from ..runner.timelines import measured_and_predicted, predict_beside
    from .timeline_table import timeline_table

    for spec, row in zip(specs, rows):
        if not row.timeline_file:
            console.print(
                escape(f"{row.method}: no timeline ({row.status}: {row.error or 'not recorded'})"), highlight=False
            )
            continue
        console.print(f"predicting {row.method}'s timeline on fake tensors ...", highlight=False)
        made = predict_beside(spec, row, out)
        if isinstance(made, str):
            console.print(escape(f"{row.method}: no prediction ({made})"), highlight=False, soft_wrap=True)
        with user_errors():
            measured, predicted = measured_and_predicted(row, out.parent)
        print_table(console, timeline_table(row, measured, predicted))
        console.print(escape(f"timeline: {out.parent / row.timeline_file}"), highlight=False, soft_wrap=True)


def print_traces(console: Console, specs: list[RunSpec], rows: list[ResultRow], out: Path) -> None:
    """Each row's trace file, or why it has none; one line for all the points without timed steps."""
    untimed = [spec.method for spec in specs if not spec.repeats]
    if untimed:
        console.print(
            f"no trace for {', '.join(untimed)}: --repeats 0 runs no timed step, and the traced step follows them",
            highlight=False,
            soft_wrap=True,
        )
    for spec, row in zip(specs, rows):
        if not spec.repeats:
            continue
        if row.trace_file:
            console.print(escape(f"{row.method}: trace {out.parent / row.trace_file}"), highlight=False, soft_wrap=True)
        else:
            why = row.error or "the profiler failed in the worker; the row is kept"
            console.print(escape(f"{row.method}: no trace ({row.status}: {why})"), highlight=False)


def interrupted_line(rows: list[ResultRow], specs: list[RunSpec], out: Path) -> str:
    """What Ctrl-C left: the finished points' rows are in the CSV; the rest were not measured."""
    line = f"interrupted: {len(rows)} of {len(specs)} row(s) kept in {out}"
    line += f" ({', '.join(row.method for row in rows)})" if rows else ""
    lost = ", ".join(spec.method for spec in specs[len(rows) :])
    return line + (f"; not measured: {lost}" if lost else "")


def written_line(rows: list[ResultRow], earlier: dict[tuple, dict], out: Path) -> str:
    """Where the rows went, and what of an earlier run they replaced, kept or sit beside (rows are
    upserted by point: a rerun of the same point replaces its row, unless it failed where the
    earlier row was ok: records.keeps_earlier)."""
    found = [(row, earlier.get(row_key(row))) for row in rows]
    kept = [(row, old) for row, old in found if old is not None and keeps_earlier(old, row.as_dict())]
    replaced = [old for row, old in found if old is not None and not keeps_earlier(old, row.as_dict())]
    parts = []
    if len(kept) < len(rows) or not kept:
        parts.append(f"{len(rows) - len(kept)} row(s) written to {out}")
        if replaced:
            parts[0] += f", {len(replaced)} of them replacing rows of an earlier run ({_run_of(replaced)})"
    if kept:
        methods = ", ".join(row.method for row, _ in kept)
        parts.append(
            f"{out} keeps the ok row(s) of {methods} from an earlier run ({_run_of([old for _, old in kept])}):"
            " a failed rerun does not replace a measurement; it is noted in the row's error column"
        )
    others = len(earlier) - len(replaced) - len(kept)
    if others:
        parts.append(f"{others} row(s) of other points from earlier runs are also in it")
    return "; ".join(parts)


def _run_of(rows: list[dict]) -> str:
    """The commits and times of earlier rows: "commit 1a2b3c4, 2025-01-01T00:00:00+00:00"."""
    commits = sorted({_commit(row) for row in rows})
    times = sorted(row.get("timestamp_utc") or "time unknown" for row in rows)
    when = times[0] if times[0] == times[-1] else f"{times[0]} to {times[-1]}"
    return f"commit {', '.join(commits)}, {when}"


def _commit(row: dict) -> str:
    commit = (row.get("git_commit") or "unknown")[:7]
    return commit + ("-dirty" if row.get("git_dirty") == "true" else "")


def warn_if_busy() -> None:
    """One line on stderr when the machine's load exceeds its CPUs."""
    warning = busy_warning()
    if warning:
        print(warning, file=sys.stderr, flush=True)


def warn_if_loaded(console: Console, rows: list[ResultRow]) -> None:
    """Under the results table, where it is read: a warning when some of its times were taken at
    load above the cores (the warning at the start sees only the load before the first point)."""
    warning = load_warning(rows)
    if warning:
        console.print(warning, style="yellow", highlight=False)  # folded to the width, as the table is


def _measuring(spec: RunSpec) -> str:
    return f"measuring {spec.method} ({spec.model}, T={spec.seq_len}, {spec.device})"
