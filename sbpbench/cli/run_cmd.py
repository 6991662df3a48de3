"""`sbp run`: measure peak memory and time of each method at one point, one process per method."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from ..config import RunSpec, point_specs
from ..config.run import check_measurable
from ..measure.threads import busy_warning
from ..measure.units import gib
from ..records import ResultRow, check_writable
from ..runner import run_points
from .errors import user_errors
from .options import RUN_FIELDS, OutOpt, point_command
from .progress import Progress
from .tables import point_title, print_table, results_table

DEFAULT_OUT = Path("results/runs.csv")


@point_command(RUN_FIELDS)
def run(settings: dict, methods: tuple[str, ...], out: OutOpt = None) -> None:
    """Measure peak memory and step time of each method at one (model, T) point, one process per
    method, and add the rows to a results CSV (default: results/runs.csv). With no options: a real
    comparison on a GPU (Qwen/Qwen3-4B, T=9000, bf16), about a minute on an idle 2-core CPU
    (small/qwen3, T=2048, fp32)."""
    out = out or DEFAULT_OUT
    with user_errors():
        specs = point_specs(settings, methods)
        check_measurable(specs)
        check_writable(out)
    console = Console()
    warn_if_busy()
    rows = []
    # user_errors: a write that fails after a point was measured says where its row was kept
    with user_errors(), Progress(console, len(specs)) as progress:
        progress.start(_measuring(specs[0]))
        for row in run_points(specs, out):  # one environment capture for all points
            rows.append(row)
            progress.advance(point_line(row))
            if len(rows) < len(specs):
                progress.start(_measuring(specs[len(rows)]))
    first = rows[0]
    limit = f", limit {first.memory_limit_bytes / 2**30:.2f} GiB" if first.memory_limit_bytes else ""
    threads = f", {first.num_threads} thread(s)" if first.num_threads else ""
    title = f"{point_title(rows)}{limit}\n{first.device_name} ({first.memory_source}{threads})"
    print_table(console, results_table(rows, title))
    for row in rows:
        if row.error:
            console.print(f"{row.method}: {row.status}: {row.error}", highlight=False, soft_wrap=True)
    console.print(f"{len(rows)} row(s) written to {out}", highlight=False, soft_wrap=True)
    if any(row.status in ("error", "timeout") for row in rows):
        raise typer.Exit(1)


def warn_if_busy() -> None:
    """One line on stderr when the machine's load exceeds its CPUs."""
    warning = busy_warning()
    if warning:
        print(warning, file=sys.stderr, flush=True)


def point_line(row: ResultRow) -> str:
    """How a finished point ended, in one line."""
    line = f"{row.method} T={row.seq_len}: {row.status}"
    if row.peak_allocated_bytes is not None:
        line += f", peak {gib(row.peak_allocated_bytes)} GiB"
    if row.time_median_s is not None:
        line += f", {row.time_median_s:.3f} s/step"
    return line


def _measuring(spec: RunSpec) -> str:
    return f"measuring {spec.method} ({spec.model}, T={spec.seq_len}, {spec.device})"
