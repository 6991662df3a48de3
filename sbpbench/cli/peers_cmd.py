"""`sbp peers setup official`: create the virtualenv the official StreamBP code runs in."""

from __future__ import annotations

import subprocess
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from .errors import user_errors
from .options import examples
from .outcomes import FAILED, end

# runner/official.py VENV_VARIABLE and DEFAULT_VENV, named here so that help imports no torch;
# tests/cli/test_cli_startup.py checks they agree
VENV_VARIABLE = "SBP_OFFICIAL_VENV"
DEFAULT_VENV = "~/.cache/sbpbench/peers/official"

peers = typer.Typer(help="Set up the peers that need an environment of their own.", no_args_is_help=True)


class Peer(StrEnum):
    official = "official"


@peers.command(
    epilog=examples(
        (
            "sbp peers setup official",
            "sbp peers setup official --path ~/venvs/official   # prints the export",
            "sbp peers setup official --wheels .whl   # no package index: carried wheels",
        )
    )
)
def setup(
    name: Annotated[
        Peer, typer.Argument(metavar="PEER", help="The peer: official (streambp 1.0, transformers 4.51.3).")
    ],
    path: Annotated[
        Path | None,
        typer.Option(
            "--path", metavar="DIR", help=f"Where to create it (default: ${VENV_VARIABLE} or {DEFAULT_VENV})."
        ),
    ] = None,
    wheels: Annotated[
        Path | None,
        typer.Option(
            "--wheels",
            metavar="DIR",
            help="Install from the wheels in DIR instead of the package index (streambp, transformers 4.51.3 and what "
            "it needs that this environment lacks).",
        ),
    ] = None,
) -> None:
    """Create the peer's virtualenv: streambp 1.0 and transformers 4.51.3 on this environment's torch."""
    from ..runner.official import setup_commands, venv_dir

    with user_errors():
        if wheels is not None and not wheels.is_dir():
            raise ValueError(f"--wheels {wheels} is not a directory; give the folder the wheels were downloaded to")
    target = (path or venv_dir()).expanduser()
    for command in setup_commands(target, wheels.resolve() if wheels is not None else None):
        typer.echo("$ " + " ".join(command))
        if subprocess.run(command, check=False).returncode:
            typer.echo(f"error: the command above failed; {target} is incomplete", err=True)
            end(FAILED)
    if path is not None:
        typer.echo(f"export {VENV_VARIABLE}={target}  # so that sbp finds it")
    typer.echo(f"ready: {target}")
