"""`sbp --help` answers at once: the CLI loads no torch or transformers until a command runs, each
command's help is whole and ends with examples, and its options come from the settings table
through Typer's public API."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import sbpbench.cli
from sbpbench.cli import peers_cmd, selftest_cmd
from sbpbench.cli.errors import error_kind, user_errors
from sbpbench.cli.flags import FLAGS
from sbpbench.cli.options import BudgetOpt, point_command
from sbpbench.core import UnsupportedModelError
from sbpbench.runner import budget, official, selftest
from sbpbench.settings import ConfigError

from ..conftest import cli_env

HEAVY = ("torch", "transformers")

# In a fresh interpreter: import the CLI, then ask for every help (the commands listed by `sbp
# --help`, and a group's own commands, as docs/commands.md walks them), and report the helps and
# which heavy modules got loaded.
_HELPS = textwrap.dedent(
    """
    import json, sys
    imported = sorted(set(sys.argv[1:]) & set(sys.modules))
    from sbpbench.cli import app
    after_import = sorted(set(sys.argv[1:]) & set(sys.modules))
    from sbpbench.cli.docs_page import command_helps, render_help

    helps = {"": render_help(), **{command.name: command.text for command in command_helps()}}
    after_helps = sorted(set(sys.argv[1:]) & set(sys.modules))
    print(json.dumps({"before": imported, "import": after_import, "helps": helps, "after": after_helps}))
    """
)


@pytest.fixture(scope="module")
def helps() -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _HELPS, *HEAVY], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout)


def test_importing_the_cli_and_every_help_load_no_torch(helps):
    """`import sbpbench.cli`, `sbp --help` and every `sbp <command> --help` leave torch and
    transformers out of sys.modules."""
    assert helps["before"] == [] and helps["import"] == [] and helps["after"] == []
    assert {"", "run", "maxlen", "sweep", "estimate", "plan", "check", "peers", "peers setup"} <= set(helps["helps"])


def test_sbp_help_shows_whole_summaries(helps):
    """Each command's summary in `sbp --help` is a whole sentence (not cut with "..."), on one line."""
    commands = helps["helps"][""].partition("Commands:")[2].splitlines()
    summaries = [line.split(maxsplit=1)[1] for line in commands if line.strip()]
    assert len(summaries) >= 12
    assert all(summary.endswith(".") and not summary.endswith("...") for summary in summaries), summaries


def test_every_command_help_ends_with_examples_within_80_columns(helps):
    """Every command's help (groups aside) ends with two or three `sbp <command> ...` examples, and
    every line of every help fits 80 columns."""
    for name, text in helps["helps"].items():
        wide = [line for line in text.splitlines() if len(line) > 80]
        assert not wide, f"sbp {name} --help: {wide[0]!r}"
        if name in ("", "peers"):
            continue
        lines = [line.strip() for line in text.rstrip().splitlines()]
        examples = lines[lines.index("Examples:") + 1 :]
        assert 2 <= len(examples) <= 3 and all(line.startswith(f"sbp {name}") for line in examples), (name, examples)


def test_run_help_is_short_and_its_options_come_in_the_table_order(helps):
    """`sbp run --help` fits one screen and a half (it was 79 lines with no example): the point's
    settings first, then how it is measured, then the methods' knobs."""
    text = helps["helps"]["run"]
    assert len(text.splitlines()) <= 66  # 70 before the knobs other than the axes went to --set; --sp: 66
    order = [text.index(flag) for flag in ("--method", "--seq", "--dtype", "--protocol", "--repeats", "--chunk-size")]
    assert order == sorted(order)
    assert "<str>" not in text and "<list[str]>" not in text


def test_help_names_what_the_heavy_modules_define():
    """The help's copies of runner constants (so that help imports no torch) agree with them."""
    assert peers_cmd.VENV_VARIABLE == official.VENV_VARIABLE
    assert peers_cmd.DEFAULT_VENV.replace("~", str(official.Path.home()), 1) == str(official.DEFAULT_VENV)
    assert selftest_cmd.BUDGET_S == {"cuda": selftest.GPU_BUDGET_S, "cpu": selftest.CPU_BUDGET_S}
    assert selftest_cmd.MIN_BUDGET_S == budget.MIN_START_S
    assert f"under {budget.MIN_START_S:g} s left" in BudgetOpt.__metadata__[0].help


def test_point_command_builds_options_from_the_settings_table():
    """A command's options are its settings' flags (older spellings kept, aliases added, help
    replaced where asked); what it receives is the settings given, numbers parsed, and the methods."""
    received = {}

    @point_command(
        ("method", "seq_len", "dtype"), helps={"dtype": "Only fp64 here."}, aliases={"seq_len": ("--start",)}
    )
    def command(settings: dict, methods: tuple[str, ...], verbose: bool = False) -> None:
        received.update(settings=settings, methods=methods, verbose=verbose)

    app = typer.Typer(rich_markup_mode=None)  # as sbp's: plain help
    app.command()(command)
    app.command("other")(lambda: None)  # two commands: the first is called by name
    runner = CliRunner()
    text = runner.invoke(app, ["command", "--help"], env={"COLUMNS": "120"}).output
    for flag in ("--method", "-T, --seq", "--start", "--dtype", "--verbose", "Only fp64 here.", "One of: bp, ckpt"):
        assert flag in text, flag
    result = runner.invoke(app, ["command", "--start", "64", "--method", "bp", "ckpt,streambp", "--verbose"])
    assert result.exit_code == 0, result.output
    assert received == {"settings": {"seq_len": 64}, "methods": ("bp", "ckpt", "streambp"), "verbose": True}
    result = runner.invoke(app, ["command", "-T", "abc"])
    assert result.exit_code == 2 and "--seq must be an integer, got 'abc'" in result.output
    assert FLAGS["seq_len"] == "--seq" and FLAGS["fp32_grad_accumulation"] == "--set fp32_grad_accumulation"


def test_other_knobs_come_through_set_and_former_flags_still_work():
    """`--set KNOB=VALUE` (repeatable) gives a knob as its setting's kind; a knob's former flag still
    parses but is hidden; an unknown knob, a bad value or a knob given twice is a one-line error
    naming it and what is allowed; `--set help` lists the knobs from the table."""
    received = {}

    @point_command(("method", "chunk_size", "fp32_grad_accumulation", "mlp_tile_size"))
    def command(settings: dict, methods: tuple[str, ...]) -> None:
        received.update(settings)

    app = typer.Typer(rich_markup_mode=None)
    app.command()(command)
    app.command("other")(lambda: None)
    runner = CliRunner()
    text = runner.invoke(app, ["command", "--help"], env={"COLUMNS": "120"}).output
    assert "--set" in text and "--chunk-size" in text and "--mlp-tile-size" not in text
    argv = ["command", "--set", "fp32_grad_accumulation=off", "--set", "chunk-size=T/3", "--mlp-tile-size", "64"]
    assert runner.invoke(app, argv).exit_code == 0
    assert received == {"fp32_grad_accumulation": False, "chunk_size": "T/3", "mlp_tile_size": 64}
    for words, message in (
        (["--set", "tile=3"], "--set: unknown knob 'tile'; this command takes chunk_size, fp32_grad_accumulation"),
        (["--set", "fp32_grad_accumulation=maybe"], "--set fp32_grad_accumulation must be true or false, got 'maybe'"),
        (["--set", "mlp_tile_size=x"], "--set mlp_tile_size must be an integer, got 'x'"),
        (["--set", "mlp_tile_size"], "--set takes KNOB=VALUE"),
        (["--set", "mlp_tile_size=8", "--mlp-tile-size", "8"], "--set mlp_tile_size given twice"),
    ):
        result = runner.invoke(app, ["command", *words])
        assert result.exit_code == 2 and message in result.output, (words, result.output)
    listed = runner.invoke(app, ["command", "--set", "help"]).output.splitlines()
    assert [line.split("=")[0] for line in listed] == ["chunk_size", "fp32_grad_accumulation", "mlp_tile_size"]


def test_user_errors_are_known_by_class_without_importing_them():
    """The error table names classes: core's UnsupportedModelError (a ValueError) gets its own
    prefix, a ConfigError is shown with the flag, anything else is not a user error."""
    assert error_kind(UnsupportedModelError("x")) == "unsupported model"
    assert error_kind(ConfigError("seq_len", "must be at least 2")) == "invalid input"
    assert error_kind(FileNotFoundError("x")) == "file not found" and error_kind(KeyError("x")) is None
    with pytest.raises(typer.Exit) as exit_info, user_errors():
        raise ConfigError("seq_len", "must be at least 2, got 1")
    assert exit_info.value.exit_code == 2
    with pytest.raises(KeyError), user_errors():
        raise KeyError("a bug, not a mistake")


MAX_FUNCTION_LINES = 50  # a command parses, calls one library function and renders; the work is the runner's


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of each function in `source`, nested ones included, longer than `limit`
    (from its def to its last line: signature, docstring and body)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append((node.name, lines))
    return found


def test_no_function_of_the_cli_is_over_50_lines():
    """Every function under sbpbench/cli, a command's included, fits 50 lines: orchestration lives in
    the runner, and the checker sees a long one (a 51-line function is reported)."""
    cli = Path(sbpbench.cli.__file__).parent
    found = {path.name: long for path in sorted(cli.glob("*.py")) if (long := long_functions(path.read_text()))}
    assert not found, f"move the work into sbpbench/runner (or split it): {found}"
    body = "".join(f"    x = {i}\n" for i in range(49))
    assert long_functions(f"def f():\n{body}") == [] and long_functions(f"def f():\n{body}    y = 0\n") == [("f", 51)]


# In a fresh interpreter with an empty HF cache, offline: commands given a mistyped model or a size
# without its unit; each one's exit code, its output, and whether torch got loaded.
_EARLY = textwrap.dedent(
    """
    import json, sys
    from typer.testing import CliRunner
    from sbpbench.cli import app

    results = {}
    for args in json.loads(sys.argv[1]):
        result = CliRunner().invoke(app, args)
        results[" ".join(args)] = [result.exit_code, " ".join(result.output.split())]
    print(json.dumps({"results": results, "torch": "torch" in sys.modules}))
    """
)
TYPOS = [
    ([command, "--model", model], f"did you mean {meant}?")
    for command in ("run", "estimate", "maxlen", "check", "plan")
    for model, meant in (("tiny/qwen9", "tiny/qwen3"), ("Qwen/Qwen3-8b", "Qwen/Qwen3-8B"))
]
UNITLESS = [
    (["estimate", "--gpu-memory", "80"], "--gpu-memory '80' has no unit: write 80GiB"),
    (["run", "--memory-limit", "1"], "--memory-limit '1' has no unit: write 1GiB"),
    (["maxlen", "--memory-limit", "1"], "--memory-limit '1' has no unit"),
    (["maxlen", "--simulate", "--gpu-memory", "80"], "--gpu-memory '80' has no unit"),
    (["maxlen", "--simulate", "--host-memory", "100"], "--host-memory '100' has no unit"),
]


def _early(cases, tmp_path) -> dict:
    env = {**cli_env(), "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    args = json.dumps([call for call, _ in cases])
    done = subprocess.run([sys.executable, "-c", _EARLY, args], capture_output=True, text=True, timeout=120, env=env)
    return json.loads(done.stdout)


def test_a_mistyped_model_is_answered_before_torch_loads(tmp_path):
    """`--model tiny/qwen9` or `Qwen/Qwen3-8b` (not cached) fails with "did you mean" in every
    point command while the options are parsed: torch is never imported, so no seconds go by."""
    answer = _early(TYPOS, tmp_path)
    assert not answer["torch"]
    for call, expected in TYPOS:
        code, output = answer["results"][" ".join(call)]
        assert code == 2 and expected in output, (call, output)


def test_a_size_without_a_unit_is_refused_before_torch_loads(tmp_path):
    """`--gpu-memory 80`, `--memory-limit 1`, `--host-memory 100`: one line that says which unit to
    add, exit 2, before torch is imported (nothing measured, nothing predicted as 80 bytes)."""
    answer = _early(UNITLESS, tmp_path)
    assert not answer["torch"]
    for call, expected in UNITLESS:
        code, output = answer["results"][" ".join(call)]
        assert code == 2 and expected in output and "Traceback" not in output, (call, output)


def test_plan_refuses_a_size_without_a_unit():
    """`sbp plan --gpu-memory 80` and `--host-memory 100` stop at once with the unit to add, not
    "nothing fits" after a search."""
    for args, expected in (
        (["--gpu-memory", "80"], "'80' has no unit"),
        (["--host-memory", "100"], "'100' has no unit"),
    ):
        result = CliRunner().invoke(sbpbench.cli.app, ["plan", "--model", "tiny/qwen3", *args])
        assert result.exit_code == 2 and expected in " ".join(result.output.split()), result.output
