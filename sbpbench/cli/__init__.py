"""The `sbp` command line: thin Typer commands, one module each."""

from __future__ import annotations

import warnings

import typer

from .check_cmd import check
from .env_cmd import env
from .estimate_cmd import estimate
from .maxlen_cmd import maxlen
from .models_cmd import models
from .peers_cmd import peers
from .plan_cmd import plan_command
from .plot_cmd import plot
from .report_cmd import report
from .run_cmd import run
from .selftest_cmd import selftest
from .sweep_cmd import sweep

app = typer.Typer(
    name="sbp",
    help="Exact StreamBP and a benchmark of backpropagation methods on long sequences.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode=None,
)
app.command()(run)
app.command()(maxlen)
app.command()(sweep)
app.command()(estimate)
app.command("plan")(plan_command)
app.command()(check)
app.command()(selftest)
app.command()(env)
app.command()(models)
app.command()(plot)
app.command()(report)
app.add_typer(peers, name="peers")


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def main() -> None:
    warnings.formatwarning = _one_line_warning  # e.g. a results-CSV row skipped: one line, no source
    app()
