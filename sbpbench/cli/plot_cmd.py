"""`sbp plot`: every figure a results table has the data for, as PNG and SVG files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .errors import user_errors
from .options import ReferenceOpt, ResultsArg

EXAMPLES = (  # the end of its help (options.py examples)
    "sbp plot results/                          # every CSV under it, into plots/",
    "sbp plot results/runs.csv --out plots/mine --format pdf",
)


def check_figure_dir(out: Path) -> None:
    """Fail before any figure is drawn if `out` is not a folder this process can write into: a
    regular file, or a folder whose nearest existing one takes no new file (probed with a file of
    its own); nothing is created."""
    import tempfile

    from ..records import not_writable

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a folder for the figures, e.g. --out plots")
    existing = next(folder for folder in (out.absolute(), *out.absolute().parents) if folder.exists())
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".sbp-probe-"):
            pass
    except OSError as error:
        raise not_writable(out, error, "cannot write figures there") from None


def plot(
    results: ResultsArg,
    out: Annotated[
        Path, typer.Option("--out", "-o", metavar="DIR", help="Directory for the figures (created).")
    ] = Path("plots"),
    reference: ReferenceOpt = None,
    formats: Annotated[
        list[str] | None,
        typer.Option(
            "--format", metavar="[png|svg|pdf]", help="png, svg or pdf; several allowed (default: png and svg)."
        ),
    ] = None,
) -> None:
    """Draw every figure a results table has the data for.

    Peak memory vs T, step time vs T, max T per model and time per sample vs batch size, each
    with the paper's numbers faint where they exist; prints the files written. CPU times taken at a
    load above the cores are drawn hollow, and the figure's title counts them."""
    from ..models import full_depth
    from ..plot import FORMATS, plot_all
    from ..report.inputs import load_paper, load_table

    with user_errors():
        check_figure_dir(out)
        table = load_table(results)
        paper, note = load_paper(reference)
        chosen = tuple(dict.fromkeys(f for value in formats or [] for f in value.replace(",", " ").split()))
        paths = plot_all(table, out, paper, chosen or FORMATS, full_depth=full_depth)
    if note:
        typer.echo(note, err=True)
    if not paths:
        typer.echo(
            f"no figure: {results} has no method timed or measured at two or more T, no max-length search "
            "and no batch-size series; add points with `sbp run`"
        )
        return
    for path in paths:
        typer.echo(str(path))
    typer.echo(f"{len(paths)} file(s) written to {out}")
