"""The `sbp` command line: thin Typer commands, one module each.

Importing it loads no torch or transformers: a command imports what it runs inside its function,
so `sbp --help` and `sbp <command> --help` answer at once (tests/cli/test_cli_startup.py). Each
command's first docstring line is its summary in `sbp --help`; its module's EXAMPLES end its help.
"""

from __future__ import annotations

import shutil
import signal
import sys
import textwrap
import warnings
from typing import Annotated

import typer

from ..settings import SettingChanged
from . import (
    check_cmd,
    env_cmd,
    estimate_cmd,
    maxlen_cmd,
    models_cmd,
    plan_cmd,
    plot_cmd,
    report_cmd,
    run_cmd,
    selftest_cmd,
    sweep_cmd,
)
from .flags import FLAGS
from .options import examples
from .peers_cmd import peers

app = typer.Typer(
    name="sbp",
    help="Exact StreamBP and a benchmark of backpropagation methods on long sequences.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode=None,
)
for module, command, name in (
    (run_cmd, run_cmd.run, "run"),
    (maxlen_cmd, maxlen_cmd.maxlen, "maxlen"),
    (sweep_cmd, sweep_cmd.sweep, "sweep"),
    (estimate_cmd, estimate_cmd.estimate, "estimate"),
    (plan_cmd, plan_cmd.plan_command, "plan"),
    (check_cmd, check_cmd.check, "check"),
    (selftest_cmd, selftest_cmd.selftest, "selftest"),
    (env_cmd, env_cmd.env, "env"),
    (models_cmd, models_cmd.models, "models"),
    (plot_cmd, plot_cmd.plot, "plot"),
    (report_cmd, report_cmd.report, "report"),
):
    app.command(name, epilog=examples(module.EXAMPLES))(command)
app.add_typer(peers, name="peers")
TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process SIGTERM ended


def _version(shown: bool) -> None:
    if shown:
        from importlib.metadata import version

        print(f"sbp {version('sbpbench')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Exact StreamBP and a benchmark of backpropagation methods on long sequences."""


def _terminated(signum, frame) -> None:
    """SIGTERM: one line, as Ctrl-C's, then exit 143; unwinding runs the cleanups (worker processes,
    temporary files) that an unhandled signal would skip."""
    print("terminated (SIGTERM): rows already written are kept", file=sys.stderr)
    raise SystemExit(TERMINATED)


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A warning without its source line: one line into a pipe or file (a log keeps it whole for
    grep), folded to the width of a terminal."""
    if isinstance(message, SettingChanged):  # the user typed a flag, not a field name
        text = f"notice: {message.naming(FLAGS.get(message.field, message.field))}"
    else:
        text = f"warning: {message}"
    if not sys.stderr.isatty():
        return text + "\n"
    width = shutil.get_terminal_size((80, 24)).columns
    return textwrap.fill(text, width=max(40, width), subsequent_indent="  ", break_on_hyphens=False) + "\n"


def main() -> None:
    warnings.formatwarning = _one_line_warning  # e.g. a results-CSV row skipped: one line, no source
    signal.signal(signal.SIGTERM, _terminated)
    app()
