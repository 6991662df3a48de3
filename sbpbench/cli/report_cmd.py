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
    from ..report.inputs import load_table

    with user_errors():
        table = load_table(results)
        paper, note = _paper(reference)
        checked = _exactness_rows(exactness) if exactness is not None else None
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


def _paper(reference: Path | None):
    """report/inputs.py `load_paper`, with a file that is not text said as one line naming it."""
    from ..report.inputs import load_paper

    try:
        return load_paper(reference)
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{reference} is not a paper reference CSV: byte {error.start} is not UTF-8 text; "
            "pass --reference PATH/streambp_paper.csv"
        ) from None


def _exactness_rows(path: Path) -> list[dict[str, str]]:
    """read_exactness(path), with a missing file, a folder or a file that is not text said as one line naming it."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not an exactness CSV; give the file `sbp check --out FILE` wrote")
    if not path.is_file():
        raise FileNotFoundError(f"no exactness CSV at {path}; write one with `sbp check --out {path}`")
    try:
        return read_exactness(path)
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{path} is not an exactness CSV: byte {error.start} is not UTF-8 text; give one written by `sbp check --out`"
        ) from None
