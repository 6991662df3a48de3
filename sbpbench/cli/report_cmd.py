"""`sbp report`: the results beside the paper's numbers, as Markdown (stdout or a file)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..records import not_writable
from ..records.exactness import read_exactness
from .errors import user_errors
from .options import ReferenceOpt, ResultsArg

EXAMPLES = (  # the end of its help (options.py examples)
    "sbp report results/                        # print Markdown",
    "sbp report results/cpu/peers_cpu.csv --glance   # one row per method",
    "sbp report results/gpu/NVIDIA-H100-80GB-HBM3 --points   # GPU points",
)


ReportOutOpt = Annotated[
    Path | None,
    typer.Option("--out", "-o", metavar="FILE", help="Write the Markdown to this file (default: print it)."),
]
ExactnessCsvOpt = Annotated[
    Path | None,
    typer.Option(
        "--exactness",
        metavar="CSV",
        help="An exactness CSV written by `sbp check --out`: its table, and the peers' column.",
    ),
]
GlanceOpt = Annotated[
    bool,
    typer.Option(
        "--glance", help="Only the summary table: one row per method, at the lengths every method ran (README.md's)."
    ),
]
PointsOpt = Annotated[
    bool,
    typer.Option(
        "--points",
        help="Only the GPU points: each measured peak beside its estimate and the paper's number (README.md's).",
    ),
]


def report(
    results: ResultsArg,
    out: ReportOutOpt = None,
    reference: ReferenceOpt = None,
    exactness: ExactnessCsvOpt = None,
    glance: GlanceOpt = False,
    points: PointsOpt = False,
) -> None:
    """Compare results with the paper's numbers, as Markdown.

    The ratio ours / paper on comparable devices, the rows the paper has no counterpart for, and
    estimates beside measurements."""
    from ..models import full_depth
    from ..report import glance_markdown, markdown_report, points_markdown
    from ..report.inputs import load_paper, load_table

    with user_errors():
        table = load_table(results)
        paper, note = load_paper(reference)
        checked = read_exactness(exactness) if exactness is not None else None
        if glance and points:
            raise ValueError("--glance and --points are two summaries: give one")
        if glance:
            text = glance_markdown(table, exactness=checked)
        elif points:
            text = points_markdown(table, paper, full_depth=full_depth)
        else:
            text = markdown_report(table, paper, full_depth=full_depth, exactness=checked)
        if out is not None:
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(text)
            except OSError as error:
                raise not_writable(out, error, "the write failed") from None
    if note:
        typer.echo(note, err=True)
    if out is None:
        typer.echo(text, nl=False)
    else:
        typer.echo(f"report written to {out}")
