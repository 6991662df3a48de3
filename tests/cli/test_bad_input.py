"""Bad input a newcomer gives: each a one-line error (or warning) before any work, with
advice that works, and nothing measured is lost."""

from __future__ import annotations

import errno
import os
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.config import point_specs
from sbpbench.config.experiment import load_experiment
from sbpbench.config.run import BeyondContextWarning, check_measurable
from sbpbench.records import NotWritable, ResultRow, RowsNotSaved, check_writable, read_rows, store, upsert_rows
from sbpbench.records.exactness import ExactnessRow, write_exactness
from sbpbench.runner import run_points

from ..conftest import cli_env

runner = CliRunner()
TINY = ["--model", "tiny/qwen3", "--seq", "16", "--method", "bp"]
FOREIGN = "date,price\n2026-01-01,3\n"  # a CSV another program wrote
GRID = '[[points]]\nmodel = "tiny/qwen3"\nmethod = "bp"\nseq_len = 16\ndevice = "cpu"\n'


def _line(result) -> str:
    return " ".join(result.output.split())


@pytest.mark.parametrize(
    ("command", "kind"),
    [
        (["run", *TINY, "--device", "cpu"], "results CSV"),
        (["maxlen", *TINY, "--device", "cpu", "--max-seq", "32"], "results CSV"),
        (["maxlen", *TINY, "--simulate", "--max-seq", "32"], "results CSV"),
        (["estimate", *TINY], "results CSV"),
        (["check", *TINY, "--method", "ckpt", "--num-layers", "1"], "exactness CSV"),  # bp alone compares nothing
        (["sweep", "GRID"], "results CSV"),
    ],
    ids=["run", "maxlen", "maxlen-simulate", "estimate", "check", "sweep"],
)
def test_a_csv_of_another_program_as_out_is_refused_before_any_work(tmp_path, command, kind):
    """Every command that writes --out refuses a CSV without the schema's columns: exit 2, one line
    that says what to do, nothing measured (no row, no progress), the file untouched."""
    out = tmp_path / "prices.csv"
    out.write_text(FOREIGN)
    if command == ["sweep", "GRID"]:
        (tmp_path / "grid.toml").write_text(GRID)
        command = ["sweep", str(tmp_path / "grid.toml")]
    result = runner.invoke(app, [*command, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert f"{out} is not a {kind}" in _line(result)
    assert "pass another --out file name, or move" in _line(result) and "Traceback" not in result.output
    assert "row(s)" not in result.output and "measuring" not in result.output
    assert out.read_text() == FOREIGN


def test_an_empty_file_or_a_results_csv_as_out_is_accepted(tmp_path):
    """An empty file and a results CSV (extra columns kept) pass the check."""
    (tmp_path / "empty.csv").write_text("")
    check_writable(tmp_path / "empty.csv")
    upsert_rows(tmp_path / "r.csv", [ResultRow(status="ok", model="m", method="bp")])
    check_writable(tmp_path / "r.csv")


def test_rows_measured_before_a_failed_write_are_kept_beside_it(tmp_path):
    """A CSV replaced by another program's while a point ran: the write fails, the measured row goes
    to a file beside it (a results CSV), and RowsNotSaved says where in one line."""
    out = tmp_path / "runs.csv"
    (spec,) = point_specs({"model": "tiny/qwen3", "seq_len": 16, "device": "cpu"}, ["bp"])

    def measure(spec, env) -> ResultRow:
        out.write_text(FOREIGN)  # meanwhile
        return ResultRow(
            status="ok", model=spec.model, method=spec.method, seq_len=spec.seq_len, peak_allocated_bytes=7
        )

    with pytest.raises(RowsNotSaved) as error:
        list(run_points([spec], out, measure=measure))
    message = str(error.value)
    kept = Path(re.search(r"kept in (\S+\.csv)$", message).group(1))
    assert "is not a results CSV" in message and "\n" not in message
    assert kept.parent == tmp_path and out.read_text() == FOREIGN
    assert [(r["method"], r["peak_allocated_bytes"]) for r in read_rows(kept)] == [("bp", "7")]


def test_a_failed_write_in_a_command_is_one_line_naming_the_kept_rows(tmp_path, monkeypatch):
    """`sbp estimate --out` whose write fails (a full disk here): exit 2, one line, the row kept."""
    out = tmp_path / "e.csv"

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "_write_atomic", full_disk)
    result = runner.invoke(app, ["estimate", *TINY, "--out", str(out)])
    assert result.exit_code == 2, result.output
    line = _line(result)
    assert "error: results not saved:" in line and "No space left on device" in line and "Traceback" not in line
    (kept,) = tmp_path.glob("e.unsaved-*.csv")
    assert str(kept) in line and [r["method"] for r in read_rows(kept)] == ["bp"]


def test_exactness_rows_are_kept_when_their_write_fails(tmp_path):
    """`sbp check --out`'s comparison rows, too, go to a file beside an exactness CSV they cannot join."""
    out = tmp_path / "x.csv"
    out.write_text(FOREIGN)
    with pytest.raises(RowsNotSaved, match="is not an? exactness CSV.*kept in"):
        write_exactness(out, [ExactnessRow(method="streambp", result="exact")])
    (kept,) = tmp_path.glob("x.unsaved-*.csv")
    assert "streambp" in kept.read_text() and out.read_text() == FOREIGN


def test_cpu_ranks_beyond_the_usable_cores_run_with_a_notice(monkeypatch):
    """On a CPU more gloo ranks than usable cores (os.sched_getaffinity) run, sharing them: one notice
    that the memory is exact and the times are of oversubscribed cores, said once for all the points."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    specs = point_specs({"model": "tiny/qwen3", "seq_len": 16, "device": "cpu", "nproc": 4}, ["bp", "ckpt"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_measurable(specs)
    (notice,) = [str(w.message) for w in caught]
    assert "nproc 4 runs 4 ranks on 2 CPU(s)" in notice and "oversubscribed cores" in notice
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no notice where each rank has a core
        check_measurable(point_specs({"model": "tiny/qwen3", "seq_len": 16, "device": "cpu", "nproc": 2}, ["bp"]))


def test_a_sweep_with_more_cpu_ranks_than_cores_says_so_before_its_first_point(tmp_path, monkeypatch):
    """A sweep's every point is checked before the first runs: ranks beyond the cores are one notice."""
    import typer

    import sbpbench.runner.experiment

    def no_points(*args, **kwargs):
        raise typer.Exit(0)

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(sbpbench.runner.experiment, "run_experiment", no_points)
    path = tmp_path / "g.toml"
    path.write_text(GRID + "nproc = 2\n")
    with pytest.warns(UserWarning, match="nproc 2 runs 2 ranks on 1 CPU"):
        result = runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "r.csv")])
    assert result.exit_code == 0, result.output


def test_nproc_on_cuda_is_capped_by_the_visible_gpus(monkeypatch):
    """On CUDA (a stand-in for two visible GPUs) a rank per GPU: --nproc 4 from cuda:0 is one line."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    result = runner.invoke(app, ["run", *TINY, "--device", "cuda", "--nproc", "4"])
    assert result.exit_code == 2, result.output
    assert "--nproc 4 needs 4 GPUs (one per rank, from cuda:0) but 2 are visible" in _line(result)


def test_t_beyond_the_model_context_is_allowed_and_said(tmp_path):
    """T past max_position_embeddings (tiny/qwen3: Qwen3's 40,960) runs, with one warning: for a
    point (run, estimate, maxlen's first probe) and a sweep's grid (once per model); none within it."""
    with pytest.warns(BeyondContextWarning, match=r"T past tiny/qwen3's context of 40,960 tokens") as said:
        (spec,) = point_specs({"model": "tiny/qwen3", "seq_len": 10_000_000, "device": "cpu"}, ["bp"])
    assert spec.seq_len == 10_000_000 and len(said) == 1
    path = tmp_path / "long.toml"
    path.write_text(GRID.replace("seq_len = 16", "seq_len = [1024, 50000, 60000]"))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("default")  # as the CLI runs: each text once per place
        load_experiment(path)
    assert [str(w.message).split(":")[0] for w in said] == [
        "T past tiny/qwen3's context of 40,960 tokens (max_position_embeddings)"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", BeyondContextWarning)
        point_specs({"model": "tiny/qwen3", "seq_len": 40_960, "device": "cpu"}, ["bp"])


@pytest.mark.slow
def test_the_cli_says_t_beyond_context_in_one_line_before_running(tmp_path):
    """`sbp run --seq 10000000`: a one-line warning on stderr before anything else happens (here the
    --out check fails next, so nothing runs)."""
    done = subprocess.run(
        [sys.executable, "-m", "sbpbench", "run", *TINY, "--seq", "10000000", "--out", str(tmp_path / "r.txt")],
        capture_output=True,
        text=True,
        timeout=300,
        env=cli_env(),
        check=False,
    )
    lines = done.stderr.splitlines()
    assert lines[0].startswith("warning: T past tiny/qwen3's context of 40,960 tokens"), done.stderr
    assert lines[1].startswith("error: invalid input: results go to a .csv file") and len(lines) == 2


def _advice(command: str, source: Path) -> list[str]:
    result = runner.invoke(app, [command, str(source)])
    assert result.exit_code == 2
    return shlex.split(re.search(r"`(sbp run [^`]*)`", _line(result)).group(1))


@pytest.mark.parametrize("command", ["plot", "report"])
def test_an_empty_folder_advises_an_out_that_sbp_run_accepts(tmp_path, command):
    """`sbp plot|report <empty folder>` advises `sbp run --out <folder>/runs.csv` (the folder itself
    is refused by sbp run), a missing CSV the CSV itself; each passes sbp run's --out check."""
    folder = tmp_path / "results"
    folder.mkdir()
    assert _advice(command, folder) == ["sbp", "run", "--out", str(folder / "runs.csv")]
    assert _advice(command, tmp_path / "later.csv") == ["sbp", "run", "--out", str(tmp_path / "later.csv")]
    check_writable(folder / "runs.csv")


@pytest.mark.slow
def test_the_advised_run_runs_and_the_folder_then_plots(tmp_path):
    """The command `sbp plot <empty folder>` advises, run as given (plus a tiny point), writes a row there."""
    folder = tmp_path / "results"
    folder.mkdir()
    quick = ["--model", "tiny/qwen3", "--seq", "16", "--method", "bp", "--repeats", "0", "--device", "cpu"]
    result = runner.invoke(app, [*_advice("plot", folder)[1:], *quick])
    assert result.exit_code == 0, result.output
    assert [r["method"] for r in read_rows(folder / "runs.csv")] == ["bp"]
    assert "no results CSV" not in _line(runner.invoke(app, ["plot", str(folder), "--out", str(tmp_path / "p")]))


@pytest.mark.parametrize("model", ["./nope", "/abs/nope", "../nope/deeper"])
def test_a_missing_checkpoint_directory_is_named_as_such(model):
    """A --model path that does not exist is 'no such directory', not 'unknown model'."""
    result = runner.invoke(app, ["run", "--model", model, "--seq", "16", "--device", "cpu"])
    assert result.exit_code == 2
    assert f"model {model}: no such directory; pass an existing checkpoint directory" in _line(result)


def test_a_directory_without_config_json_is_named_as_such(tmp_path):
    """An existing directory that is not a checkpoint says what it lacks."""
    result = runner.invoke(app, ["estimate", "--model", str(tmp_path), "--seq", "16"])
    assert result.exit_code == 2 and "the directory holds no config.json" in _line(result)


def test_an_unwritable_out_names_its_real_cause(tmp_path):
    """/proc takes no new files (ENOENT even for root): 'cannot write' with that cause, never
    'permission denied'; a refused permission is PermissionError."""
    error = store.not_writable(tmp_path / "r.csv", FileNotFoundError(errno.ENOENT, "No such file or directory"), "x")
    assert type(error) is NotWritable
    assert isinstance(
        store.not_writable(tmp_path / "r.csv", PermissionError(errno.EACCES, "denied"), "x"), PermissionError
    )
    result = runner.invoke(app, ["run", *TINY, "--device", "cpu", "--out", "/proc/nope/r.csv"])
    assert result.exit_code == 2
    assert "error: cannot write: /proc/nope/r.csv: cannot create the folder /proc/nope (No such file or directory)" in (
        _line(result)
    )
    if os.geteuid() == 0:  # root passes os.access; creating the file is what fails
        result = runner.invoke(app, ["run", *TINY, "--device", "cpu", "--out", "/proc/forbidden.csv"])
        assert "error: cannot write: /proc/forbidden.csv: cannot create a file in /proc (No such file" in _line(result)
