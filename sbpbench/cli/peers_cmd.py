"""`sbp peers setup official`: create the virtualenv the official StreamBP code runs in."""

from __future__ import annotations

import subprocess
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from ..runner.official import VENV_VARIABLE, setup_commands, venv_dir

peers = typer.Typer(help="Peers that need an environment of their own.", no_args_is_help=True)


class Peer(str, Enum):
    official = "official"


@peers.command()
def setup(
    name: Annotated[Peer, typer.Argument(help="The peer: official (streambp 1.0, transformers 4.51.3).")],
    path: Annotated[
        Path | None,
        typer.Option(
            "--path", help=f"Where to create it (default: ${VENV_VARIABLE} or ~/.cache/sbpbench/peers/official)."
        ),
    ] = None,
) -> None:
    """Create the peer's virtualenv from the package index (the same torch as here)."""
    target = (path or venv_dir()).expanduser()
    for command in setup_commands(target):
        typer.echo("$ " + " ".join(command))
        if subprocess.run(command, check=False).returncode:
            typer.echo(f"error: the command above failed; {target} is incomplete", err=True)
            raise typer.Exit(1)
    if path is not None:
        typer.echo(f"export {VENV_VARIABLE}={target}  # so that sbp finds it")
    typer.echo(f"ready: {target}")
