"""Every `sbp ...` command quoted in README.md and docs/*.md parses: its argv with --help appended
runs through the CLI (an unknown command or option fails there)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from typer.testing import CliRunner

from sbpbench.cli import app

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def quoted_commands(text: str) -> list[str]:
    """`sbp ...` in backticks, and lines of code blocks that start with sbp; placeholders skipped, and
    a command ending in an option (`sbp run --out`: a flag named, not a command)."""
    found = re.findall(r"`(sbp [^`]+)`", text)
    found += [line.strip() for line in text.splitlines() if re.match(r"^\s{2,}sbp \S", line) or line.startswith("sbp ")]
    commands = [re.split(r"\s+#", c)[0].strip().rstrip("\\").strip() for c in found]
    commands = [c for c in commands if not re.search(r"<|\.\.\.|\[|\||…|\bN\b|NAME|CSV|DIR", c)]
    return [c for c in commands if not c.split()[-1].startswith("--") or len(c.split()) < 3]


def test_every_quoted_sbp_command_parses():
    """Each quoted command, with --help appended, exits 0: its command and options exist."""
    broken = []
    for page in PAGES:
        for command in dict.fromkeys(quoted_commands(page.read_text())):
            result = CliRunner().invoke(app, [*shlex.split(command)[1:], "--help"])
            if result.exit_code != 0:
                broken.append(f"{page.name}: {command}: {result.output.strip().splitlines()[-1:]}")
    assert not broken, "\n".join(broken)


def test_a_command_with_an_unknown_option_is_caught():
    """The check above can fail: an option no command has does not parse."""
    assert quoted_commands("run `sbp plan --no-such-flag 3`") == ["sbp plan --no-such-flag 3"]
    assert CliRunner().invoke(app, ["plan", "--no-such-flag", "3", "--help"]).exit_code != 0


def named_options(text: str) -> list[tuple[str, str]]:
    """(command, option) for each option a quoted `sbp ...` names, in backticks or a code line, also
    where the command is quoted only to name an option (`sbp run --out`) or holds a placeholder."""
    found = re.findall(r"`(sbp [^`]+)`", text)
    found += [line.strip().removeprefix("$ ") for line in text.splitlines() if re.match(r"^\s*(\$ )?sbp \S", line)]
    pairs = []
    for quoted in found:
        for part in re.split(r"&&|\|", re.split(r"\s+#", quoted)[0]):
            words = part.split()
            if len(words) < 2 or words[0] != "sbp" or words[1].startswith("-"):
                continue
            command = " ".join(words[1:3]) if words[1:3] == ["peers", "setup"] else words[1]
            pairs += [
                (command, option) for word in words[2:] for option in re.findall(r"(?<![\w-])--[a-z][\w-]*", word)
            ]
    return pairs


def test_every_option_a_page_names_exists():
    """Each option a quoted command names is in that command's help: a page that says `sbp estimate
    --host-memory` is right only while estimate takes --host-memory."""
    helps: dict[str, str] = {}
    missing = []
    for page in PAGES:
        for command, option in dict.fromkeys(named_options(page.read_text())):
            if command not in helps:
                helps[command] = CliRunner().invoke(app, [*command.split(), "--help"], env={"COLUMNS": "200"}).output
            if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", helps[command]):
                missing.append(f"{page.name}: sbp {command} has no {option}")
    assert not missing, "\n".join(missing)


def test_an_option_named_without_a_value_is_checked():
    """The check above sees options in a command quoted only to name them, and in a placeholder form."""
    text = "`sbp run --out`, `sbp sweep FILE [--out results/NAME.csv] [--resume/--no-resume]`\n    sbp peers setup official --force\n"
    assert named_options(text) == [
        ("run", "--out"),
        ("sweep", "--out"),
        ("sweep", "--resume"),
        ("sweep", "--no-resume"),
        ("peers setup", "--force"),
    ]
