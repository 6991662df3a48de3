"""The `sbp` command line: thin Typer commands, one module each."""

from __future__ import annotations

import typer

from .check_cmd import check
from .env_cmd import env
from .models_cmd import models
from .run_cmd import run

app = typer.Typer(
    name="sbp",
    help="Exact StreamBP and a benchmark of backpropagation methods on long sequences.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
app.command()(run)
app.command()(check)
app.command()(env)
app.command()(models)


def main() -> None:
    app()
