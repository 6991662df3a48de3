"""docs/commands.md is every `sbp` command's help as it is now: regenerated, it comes out the same on
any machine, every command `sbp --help` lists has its section, and every examples epilog is shown."""

from __future__ import annotations

import os
import pkgutil
import re
import subprocess
import sys
import textwrap
from importlib import import_module
from pathlib import Path

import typer
from typer.testing import CliRunner

import sbpbench.cli
from sbpbench.cli import app, docs_page

PAGE = Path(__file__).resolve().parents[2] / "docs" / "commands.md"


def sections(markdown: str) -> dict[str, str]:
    """A page's sections by command name ("run", "peers setup"), each its text after the heading."""
    parts = re.split(r"^## sbp (.+)$", markdown, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def shell_block(section: str) -> list[str]:
    """The lines of a section's ```shell block ([] if it has none)."""
    return section.partition("```shell\n")[2].partition("```")[0].splitlines()


def comparable(page: str) -> str:
    """A page as any Typer that pyproject.toml allows renders it alike: the Typer version named and
    how the help's lines and columns are wrapped taken out, every word and its order kept."""
    page = re.sub(r"\(Typer [^,]+,", "(Typer,", page)
    return " ".join(page.split())


def test_committed_page_is_what_the_generator_writes_now():
    """docs/commands.md says what the generator writes now, under whatever Typer is installed (CI's
    newest allowed or the pinned one): a help changed without regenerating fails, word for word."""
    committed, now = PAGE.read_text(), docs_page.page()
    if f"(Typer {typer.__version__}," in committed:  # the Typer that wrote it: byte for byte
        assert committed == now, f"docs/commands.md is stale: run `{docs_page.REGENERATE}`"
    assert comparable(committed) == comparable(now), f"docs/commands.md is stale: run `{docs_page.REGENERATE}`"
    assert comparable("a  b\n  (Typer 0.16.0, 80 columns)") == comparable("a b (Typer 0.29.1, 80\ncolumns)")


def test_page_is_the_same_on_another_machine(tmp_path):
    """The regeneration command writes the same page under another width, colour setting, home,
    working directory, thread count and core count (no machine-dependent default in any help)."""
    out = tmp_path / "commands.md"
    fake_machine = textwrap.dedent(
        f"""
        import os, runpy, sys
        os.cpu_count = lambda: 97
        os.sched_getaffinity = lambda pid: set(range(97))
        sys.argv = ["docs_page", {str(out)!r}]
        runpy.run_module("sbpbench.cli.docs_page", run_name="__main__")
        """
    )
    env = os.environ | {"COLUMNS": "43", "FORCE_COLOR": "1", "TERM": "xterm-256color", "HOME": str(tmp_path)}
    env |= {"OMP_NUM_THREADS": "7", "SBP_OFFICIAL_VENV": str(tmp_path / "venv")}
    subprocess.run([sys.executable, "-c", fake_machine], env=env, cwd=tmp_path, check=True, timeout=120)
    assert out.read_text() == docs_page.page()


def test_every_command_sbp_help_lists_has_a_section_and_an_index_link():
    """Each command of `sbp --help`, and each command of a group it lists, has a section in
    docs/commands.md, in that order, and the index at the top links to it."""
    runner = CliRunner()

    def listed(*words: str) -> list[str]:
        text = runner.invoke(app, [*words, "--help"]).output
        return [line.split()[0] for line in text.partition("Commands:")[2].splitlines() if line.strip()]

    names = [name for command in listed() for name in (command, *(f"{command} {sub}" for sub in listed(command)))]
    assert {"run", "peers", "peers setup"} <= set(names)
    page = PAGE.read_text()
    assert list(sections(page)) == names
    index = page.partition("\n## ")[0]
    for name in names:
        assert f"[`sbp {name}`](#sbp-{name.replace(' ', '-')})" in index, name


def test_every_examples_epilog_is_shown_in_its_section():
    """Every command whose help ends with examples shows them, as written in its module's EXAMPLES,
    in a shell block of its section; a group without examples has no such block."""
    page = sections(PAGE.read_text())
    shown = {name for name, section in page.items() if shell_block(section)}
    with_examples = {h.name for h in docs_page.command_helps() if "\n  Examples:\n" in h.text}
    assert shown == with_examples and "peers setup" in shown and "peers" not in shown
    modules = [import_module(f"sbpbench.cli.{m.name}") for m in pkgutil.iter_modules(sbpbench.cli.__path__)]
    declared = {
        m.__name__.rpartition(".")[2].removesuffix("_cmd"): m.EXAMPLES for m in modules if hasattr(m, "EXAMPLES")
    }
    assert len(declared) >= 11
    for name, examples in declared.items():
        assert shell_block(page[name]) == list(examples), name


def test_no_option_shows_a_python_type_for_its_value():
    """Every option's value is named for a user (SIZE, CSV, DIR, N%|TOKENS), never Typer's fallback
    of the Python type (`<str>`, `<path>`, `<float range>`, `<list[str]>`)."""
    flag_columns = [  # an option line's flags and value name, before the help's column
        f"sbp {h.name}: {match.group(1)}"
        for h in docs_page.command_helps()
        for match in re.finditer(r"^ +(-\S.*?)(?: {2,}|$)", h.text, flags=re.MULTILINE)
    ]
    fallbacks = [line for line in flag_columns if re.search(r"<[a-z][a-z \[\]]*>", line)]
    assert flag_columns and not fallbacks, "options without a metavar:\n" + "\n".join(fallbacks)
