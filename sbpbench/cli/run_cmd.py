"""`sbp run`: measure peak memory and time of each method at one point, one process per method."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from ..config import RunSpec, point_specs
from ..records import check_writable
from ..runner import run_points
from .errors import user_errors
from .options import RUN_FIELDS, OutOpt, point_command
from .tables import point_title, results_table

DEFAULT_OUT = Path("results/runs.csv")


@point_command(RUN_FIELDS)
def run(settings: dict, methods: tuple[str, ...], out: OutOpt = None) -> None:
    """Measure peak memory and step time of each method at one (model, T) point, one process per
    method, and add the rows to a results CSV (default: results/runs.csv). With no options: a real
    comparison on a GPU (Qwen/Qwen3-4B, T=9000, bf16), about a minute on a CPU (small/qwen3,
    T=2048, fp32)."""
    out = out or DEFAULT_OUT
    with user_errors():
        specs = point_specs(settings, methods)
        check_writable(out)
        console = Console()
        rows = []
        with console.status(_measuring(specs[0])) as status:
            for row in run_points(specs, out):  # one environment capture for all points
                rows.append(row)
                if len(rows) < len(specs):
                    status.update(_measuring(specs[len(rows)]))
    first = rows[0]
    limit = f", limit {first.memory_limit_bytes / 2**30:.2f} GiB" if first.memory_limit_bytes else ""
    console.print(results_table(rows, f"{point_title(rows)}{limit}\n{first.device_name} ({first.memory_source})"))
    for row in rows:
        if row.error:
            console.print(f"{row.method}: {row.status}: {row.error}", highlight=False, soft_wrap=True)
    console.print(f"{len(rows)} row(s) written to {out}", highlight=False)
    if any(row.status in ("error", "timeout") for row in rows):
        raise typer.Exit(1)


def _measuring(spec: RunSpec) -> str:
    return f"measuring {spec.method} ({spec.model}, T={spec.seq_len}, {spec.device})"
