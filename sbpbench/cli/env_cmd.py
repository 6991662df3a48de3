"""`sbp env`: the machine, driver and versions, for bug reports and result provenance."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..measure.units import GIB
from .errors import user_errors

EXAMPLES = (  # the end of its help (options.py examples)
    "sbp env                          # a table",
    "sbp env --json > environment.json",
)


def env(
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON object with the raw values instead of a table.")
    ] = False,
    device: Annotated[
        str,
        typer.Option(
            "--device",
            metavar="DEVICE",
            help="cpu, cuda, cuda:N, or auto (cuda when NVML sees a GPU and torch has CUDA).",
        ),
    ] = "auto",
) -> None:
    """Print the device, driver, versions, CPU, RAM and git commit.

    For bug reports and the provenance of results: every row of a results CSV records the same."""
    from ..measure.environment import capture_environment

    with user_errors():
        _check_visible(device)
        values = capture_environment(device).as_dict()
    if json_output:
        typer.echo(json.dumps(values, indent=2))
        return
    Console().print(env_table(values))


def _check_visible(device: str) -> None:
    """Refuse a CUDA device when none is visible, or past the visible ones, as `sbp run` does
    (config/device.py), but counted through NVML: the parent of a GPU measurement must not
    initialise CUDA."""
    from ..config.device import check_visible
    from ..measure.environment import auto_device, gpu_index, visible_gpu_count

    index = None if device == "auto" else gpu_index(device)
    if index is not None:
        check_visible(device, index, visible_gpu_count() if auto_device() == "cuda" else 0)


def env_table(values: dict) -> Table:
    """A row per field; long values (a CPU model name, a path) fold."""
    table = Table(title="sbpbench environment (GiB = 2^30 bytes)")
    table.add_column("field", no_wrap=True)
    table.add_column("value", overflow="fold")
    for name, value in values.items():
        shown = _bytes(value) if name.endswith("_bytes") else str(value)
        table.add_row(name, Text(shown))  # Text: a name with [brackets] is not read as rich markup
    return table


def _bytes(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB ({num_bytes} B)" if num_bytes else "unknown"
