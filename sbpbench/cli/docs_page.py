"""docs/commands.md: every `sbp` command's `--help`, as Markdown, so that the docs and the CLI never
disagree. Regenerate with `python -m sbpbench.cli.docs_page docs/commands.md`.

Each help is rendered as a user sees it, through Typer's CliRunner (80 columns, no colour; a real
terminal wraps two columns sooner), and kept verbatim in a text block; only its examples epilog
moves into a shell block of its own. Commands come in the order `sbp --help` lists them, a group's
commands after the group. A module run with `python -m`, not an `sbp` command: the page is the
repository's, and `sbp` keeps to the commands users run.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from typer.testing import CliRunner

from . import app

WIDTH = 80  # columns the helps are rendered at (tests/cli/test_cli_startup.py: every help fits them)
# The environment a help is rendered in, whatever the shell's: Typer 0.29's CliRunner fixes 80 columns
# itself, older Typers read COLUMNS; no colour even where the shell forces it.
HELP_ENV = {"COLUMNS": str(WIDTH), "NO_COLOR": "1", "FORCE_COLOR": None, "TERM": "dumb"}
REGENERATE = "python -m sbpbench.cli.docs_page docs/commands.md"
EXAMPLES_HEADING = "Examples:"  # the epilog's first line (options.examples)


@dataclass(frozen=True, kw_only=True)
class CommandHelp:
    name: str  # "run", "peers setup"
    text: str  # its `--help`, trailing spaces stripped

    @property
    def summary(self) -> str:
        """The help's first paragraph after the usage, on one line."""
        return " ".join(self.text.split("\n\n")[1].split())

    @property
    def body(self) -> str:
        """The help up to its examples epilog."""
        return self.text.partition(f"\n  {EXAMPLES_HEADING}\n")[0].rstrip()

    @property
    def examples(self) -> str:
        """The examples epilog's command lines, dedented ("" if it has none)."""
        return textwrap.dedent(self.text.partition(f"\n  {EXAMPLES_HEADING}\n")[2]).rstrip()

    @property
    def anchor(self) -> str:
        return "sbp-" + self.name.replace(" ", "-")


def listed_commands(help_text: str) -> list[str]:
    """The command names a group's help lists under "Commands:", in its order."""
    return [line.split()[0] for line in help_text.partition("\nCommands:\n")[2].splitlines() if line.strip()]


def render_help(*words: str) -> str:
    result = CliRunner().invoke(app, [*words, "--help"], env=HELP_ENV)
    assert result.exit_code == 0, result.output
    return "\n".join(line.rstrip() for line in result.output.splitlines()) + "\n"


def command_helps() -> list[CommandHelp]:
    """Every command `sbp --help` lists, in its order, each group followed by its own commands."""
    helps = []
    for name in listed_commands(render_help()):
        text = render_help(name)
        helps.append(CommandHelp(name=name, text=text))
        helps += [CommandHelp(name=f"{name} {sub}", text=render_help(name, sub)) for sub in listed_commands(text)]
    return helps


def table_cell(text: str) -> str:
    return text.replace("|", r"\|")  # a bare | would end the cell


def page() -> str:
    helps = command_helps()
    lines = [
        "# Commands",
        "",
        f"Generated from each command's `--help` (Typer {typer.__version__}, {WIDTH} columns); edit the help in "
        f"`sbpbench/cli/`, not this page, then regenerate it: `{REGENERATE}`.",
        "",
        "| Command | What it does |",
        "| --- | --- |",
        *(f"| [`sbp {h.name}`](#{h.anchor}) | {table_cell(h.summary)} |" for h in helps),
    ]
    for h in helps:
        lines += ["", f"## sbp {h.name}", "", h.summary, "", "```text", h.body, "```"]
        if h.examples:
            lines += ["", EXAMPLES_HEADING, "", "```shell", h.examples, "```"]
    return "\n".join(lines) + "\n"


def write(
    out: Annotated[Path | None, typer.Argument(help="Write the page here (default: print it).")] = None,
) -> None:
    """Render docs/commands.md from every command's help."""
    text = page()
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)


if __name__ == "__main__":
    typer.run(write)
