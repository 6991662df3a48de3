"""A knob given to methods that do not read it is one notice line on stderr per knob, before any
work, naming it as the user wrote it, its readers and the methods that ignore it; never an error."""

from __future__ import annotations

import sys

import pytest
import typer
from typer.testing import CliRunner

import sbpbench.runner.experiment
import sbpbench.runner.searches
import sbpbench.simulate.depth
from sbpbench.cli import app, run_cmd, sweep_cmd
from sbpbench.config.experiment import ignored_keys
from sbpbench.settings import METHOD_KNOBS, METHOD_NAMES, SETTINGS, ignored_knobs

runner = CliRunner()
TINY = ["--model", "tiny/qwen3", "--seq", "16"]
WORK = "the work starts here"  # what the stand-in for a command's work prints on stderr


@pytest.fixture
def no_work(monkeypatch):
    """Each command's work replaced by one stderr line and a clean exit: a notice printed before it
    comes first in the output."""

    def work(*args, **kwargs):
        print(WORK, file=sys.stderr)
        raise typer.Exit(0)

    monkeypatch.setattr(run_cmd, "_measure_all", work)
    monkeypatch.setattr(sbpbench.simulate.depth, "estimate_point_by_depth", work)
    monkeypatch.setattr(sbpbench.runner.searches, "run_searches", work)
    monkeypatch.setattr(sbpbench.runner.experiment, "plan_experiment", work)
    monkeypatch.setattr(sweep_cmd, "_dry_run", work)
    monkeypatch.setattr(sweep_cmd, "_seeds_only", work)


def _notices(result) -> list[str]:
    """The notice lines, which all come before the work; exit 0 and no traceback."""
    assert result.exit_code == 0 and isinstance(result.exception, (SystemExit, type(None))), result.output
    assert "Traceback" not in result.output, result.output
    lines = result.stderr.splitlines()
    assert WORK in lines, result.output
    before = lines[: lines.index(WORK)]
    assert not [line for line in lines[lines.index(WORK) :] if line.startswith("notice:")], result.output
    return [line for line in before if line.startswith("notice:")]


def test_each_knob_lists_the_methods_that_do_not_read_it():
    """ignored_knobs follows the settings table's read_by: for every knob and method, listed exactly
    when the method is not among its readers."""
    for knob in METHOD_KNOBS:
        (found,) = ignored_knobs(METHOD_NAMES, [knob]) or [None]
        expected = tuple(m for m in METHOD_NAMES if m not in SETTINGS[knob].read_by)
        assert found is not None and found.read_by == SETTINGS[knob].read_by and found.ignored_by == expected


def test_settings_every_method_reads_and_knobs_all_methods_read_are_not_listed():
    """A point's setting (--seq, --dtype) is read by every method; a knob read by each method given says nothing."""
    assert ignored_knobs(METHOD_NAMES, ["seq_len", "dtype", "model"]) == []
    assert ignored_knobs(["streambp"], ["checkpoints", "chunk_size", "fp32_grad_accumulation"]) == []
    assert ignored_knobs([], ["checkpoints"]) == []


def test_a_commands_own_flag_takes_its_readers_and_order_is_kept():
    """`readers` adds a command's own flag, after the table's knobs; a method or knob given twice is listed once."""
    given = ["--phases", "checkpoints", "checkpoints"]
    found = ignored_knobs(["ckpt", "bp", "ckpt"], given, {"--phases": ("streambp",)})
    assert [(k.knob, k.ignored_by) for k in found] == [("checkpoints", ("ckpt", "bp")), ("--phases", ("ckpt", "bp"))]


def test_run_says_each_ignored_knob_before_measuring(no_work, tmp_path):
    """`sbp run --method bp --checkpoints stream:2 --set mlp_tile_size=512 --phases`: three notices, in the
    settings table's order, then the work."""
    args = ["run", "--device", "cpu", *TINY, "--method", "bp", "--checkpoints", "stream:2"]
    result = runner.invoke(app, [*args, "--set", "mlp_tile_size=512", "--phases", "--out", str(tmp_path / "r.csv")])
    assert _notices(result) == [
        "notice: --set mlp_tile_size is read only by tiled; bp ignores it",
        "notice: --checkpoints is read only by streambp; bp ignores it",
        "notice: --phases is read only by streambp; bp ignores it",
    ]


def test_run_says_nothing_when_every_method_reads_the_knob(no_work, tmp_path):
    """`--method streambp --checkpoints cpu --phases`: streambp reads both, no notice."""
    args = ["run", "--device", "cpu", *TINY, "--method", "streambp", "--checkpoints", "cpu", "--phases"]
    assert _notices(runner.invoke(app, [*args, "--out", str(tmp_path / "r.csv")])) == []


def test_estimate_names_only_the_methods_that_ignore_the_knob(no_work):
    """`sbp estimate --method ckpt tiled --set mlp_tile_size=512`: tiled reads it, ckpt does not."""
    result = runner.invoke(app, ["estimate", *TINY, "--method", "ckpt", "tiled", "--set", "mlp_tile_size=512"])
    assert _notices(result) == ["notice: --set mlp_tile_size is read only by tiled; ckpt ignores it"]


def test_estimate_with_the_default_methods_names_those_that_ignore_it(no_work):
    """No --method: the default bp, ckpt and streambp; a chunk size is read by streambp alone of them."""
    result = runner.invoke(app, ["estimate", *TINY, "--chunk-size", "8"])
    assert _notices(result) == ["notice: --chunk-size is read only by streambp, official; bp, ckpt ignore it"]


@pytest.mark.parametrize("simulate", [["--simulate"], ["--device", "cpu"]], ids=["simulated", "measured"])
def test_maxlen_says_it_before_the_search(no_work, tmp_path, simulate):
    """`sbp maxlen --method bp ckpt --checkpoints cpu`: one notice naming both methods, before any probe."""
    host = ["--host-memory", "1TiB"] if simulate == ["--simulate"] else []  # else a notice names the default
    args = ["maxlen", *simulate, *TINY, "--method", "bp", "ckpt", "--checkpoints", "cpu", *host]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "m.csv")])
    assert _notices(result) == ["notice: --checkpoints is read only by streambp; bp, ckpt ignore it"]


EXPERIMENT = """
name = "knobs"
description = "a knob for methods that ignore it"
[defaults]
model = "tiny/qwen3"
device = "cpu"
chunk_size = 8
[[points]]
method = ["bp", "streambp"]
seq_len = [16]
[[points]]
method = "ckpt"
seq_len = 16
mlp_tile_size = 512
[[points]]
method = "streambp"
seq_len = 16
checkpoints = "cpu"
"""


@pytest.mark.parametrize("mode", [["--dry-run"], ["--seeds-only"], []], ids=["dry-run", "seeds-only", "run"])
def test_sweep_says_each_key_once_by_its_name_in_the_file(no_work, tmp_path, mode):
    """An experiment file: one notice per key, naming the file and the key as written, with every
    entry's method that ignores it; a key its entry's methods all read (checkpoints) says nothing."""
    path = tmp_path / "knobs.toml"
    path.write_text(EXPERIMENT)
    result = runner.invoke(app, ["sweep", str(path), *mode, "--out", str(tmp_path / "r.csv")])
    assert _notices(result) == [
        f"notice: {path}: chunk_size is read only by streambp, official; bp, ckpt ignore it",
        f"notice: {path}: mlp_tile_size is read only by tiled; ckpt ignores it",
    ]


def test_a_file_that_does_not_load_has_no_notice_of_its_own(tmp_path):
    """Missing, not TOML, or naming a method that is none: no notice (loading it says what is wrong)."""
    broken = tmp_path / "broken.toml"
    broken.write_text("name = [")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('[[points]]\nmodel = "tiny/qwen3"\nmethod = "nope"\nchunk_size = 8\n')
    assert ignored_keys(tmp_path / "none.toml") == ignored_keys(broken) == ignored_keys(unknown) == []
