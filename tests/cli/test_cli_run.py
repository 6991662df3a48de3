"""`sbp run` and `sbp env` from the command line: exit codes, table, CSV rows, one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import sbpbench.runner as runner_package
from sbpbench.cli import app
from sbpbench.cli.options import parse_methods
from sbpbench.records import COLUMNS, PROVENANCE_COLUMNS, ResultRow, read_rows, upsert_rows
from sbpbench.workload.rows import spec_fields

from ..conftest import cli_env

runner = CliRunner()
TINY = ["--model", "tiny/qwen3", "--seq", "48", "--repeats", "1", "--warmup", "0"]


def _sbp() -> str:
    beside_python = Path(sys.executable).parent / "sbp"
    return str(beside_python) if beside_python.exists() else shutil.which("sbp")


def _run_sbp(*args: str) -> subprocess.CompletedProcess:
    """The installed `sbp` in a process of its own, its output captured."""
    return subprocess.run([_sbp(), *args], check=False, capture_output=True, text=True, timeout=600, env=cli_env())


@pytest.mark.slow
def test_sbp_run_in_a_real_process_writes_rows_with_full_provenance(tmp_path):
    """The installed `sbp run` with `--method bp ckpt streambp`: exit 0, a table, three rows whose
    provenance columns are all filled."""
    out = tmp_path / "results" / "runs.csv"
    done = _run_sbp("run", *TINY, "--method", "bp", "ckpt", "streambp", "--out", str(out))
    assert done.returncode == 0, done.stderr
    for text in ("bp", "ckpt", "streambp", "peak GiB", "tiny/qwen3", "3 row(s) written"):
        assert text in done.stdout
    rows = read_rows(out)
    assert [r["method"] for r in rows] == ["bp", "ckpt", "streambp"]
    assert all(r["status"] == "ok" for r in rows)
    for column in PROVENANCE_COLUMNS:
        assert all(r[column] for r in rows), f"provenance column {column} empty"
    assert set(rows[0]) == set(COLUMNS)


@pytest.mark.slow
def test_rerun_replaces_the_point_and_memory_limit_gives_an_oom_row(tmp_path):
    """Same point twice: still one row. Under --memory-limit the row is oom and the run exits 0."""
    out = tmp_path / "r.csv"
    for _ in range(2):
        result = runner.invoke(app, ["run", *TINY, "--method", "streambp", "--out", str(out)])
        assert result.exit_code == 0, result.output
    assert len(read_rows(out)) == 1
    result = runner.invoke(app, ["run", *TINY, "--method", "bp", "--memory-limit", "1MB", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "oom" in result.output
    assert [(r["method"], r["status"]) for r in read_rows(out)] == [("streambp", "ok"), ("bp", "oom")]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "nope/nope"], "unknown model 'nope/nope'"),
        (["--method", "bogus"], "unknown --method 'bogus'"),
        (["--method", "bp", "bogus"], "unknown --method 'bogus'"),
        (["--seq", "0"], "--seq must be at least 2"),
        (["--seq", "1"], "--seq must be at least 2"),
        (["--chunk-size", "0"], 'error: invalid input: --chunk-size must be an integer >= 1 or "auto", got 0'),
        (["--logits-chunk-size", "-3"], "logits-chunk-size"),
        (["--device", "cuda"], "no CUDA GPU"),
        (["--memory-limit", "lots"], "80GiB"),
        (["--protocol", "warm"], "unknown --protocol 'warm'"),
        (["--objective", "ppo"], "unknown --objective 'ppo'"),
        (["--objective", "dpo", "--batch", "3"], "even number"),
        (["--step", "adam"], "unknown --step 'adam'"),
        (["--out", "/proc/nope/r.csv"], "--out"),
        (["--out", "r.txt"], ".csv"),
        (["--out", "/proc/forbidden.csv"], "/proc/forbidden.csv: "),  # the cause: test_bad_input.py
        (["--seq", "abc"], "error: invalid input: --seq must be an integer, got 'abc'"),
        (["--timeout", "soon"], "error: invalid input: --timeout must be a number, got 'soon'"),
        (["--threads", "0"], "error: invalid input: --threads must be an integer >= 1"),
        (["--dtype", "fp16"], "error: invalid input: unknown --dtype 'fp16'"),
    ],
)
def test_bad_input_is_a_one_line_error_and_nothing_is_written(tmp_path, args, message):
    """Each bad input: non-zero exit, a message that says what to do, no traceback, the CSV untouched."""
    out = tmp_path / "r.csv"
    out.write_text("keep me\n")
    base = ["run", "--model", "tiny/qwen3", "--seq", "16", "--out", str(out)]
    result = runner.invoke(app, [*base, *args])
    assert result.exit_code != 0
    assert message in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output
    assert out.read_text() == "keep me\n"


@pytest.mark.slow
def test_dpo_lora_train_point_from_the_command_line(tmp_path):
    """`--objective dpo --lora-rank 4 --step train`: one pair by default, rows say objective, LoRA and step."""
    out = tmp_path / "r.csv"
    args = ["run", *TINY, "--method", "streambp", "--objective", "dpo", "--lora-rank", "4", "--step", "train"]
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    (row,) = read_rows(out)
    assert (row["objective"], row["lora_rank"], row["step"], row["batch_size"]) == ("dpo", "4", "train", "2")
    assert int(row["optimizer_state_bytes"]) > 0 and row["status"] == "ok"


def test_method_lists_in_every_spelling():
    """--method takes separate or comma-joined names, drops repeats, and defaults to all three."""
    assert parse_methods(["bp", "ckpt,streambp"]) == ("bp", "ckpt", "streambp")
    assert parse_methods(["bp", "bp"]) == ("bp",)
    assert parse_methods([]) == ()  # none named: the config runs every method


def test_sbp_env_json_parses():
    """`sbp env --json` is valid JSON with the torch version and git commit filled."""
    result = runner.invoke(app, ["env", "--json"])
    assert result.exit_code == 0
    values = json.loads(result.output)
    assert values["torch_version"] and values["git_commit"]


def _stub_runner(commit: str, finished: str, *, interrupt_after: int | None = None, **values):
    """A run_points that measures nothing: each spec's row (ok, from `commit` at `finished`, with
    `values`) is upserted then yielded, as the real one does; after `interrupt_after` rows, Ctrl-C."""

    def run_points(specs, out):
        for i, spec in enumerate(specs):
            if i == interrupt_after:
                raise KeyboardInterrupt
            row = ResultRow(**spec_fields(spec), status="ok", device_name="a CPU", git_commit=commit, git_dirty="false")
            for name, value in values.items():
                setattr(row, name, value)
            row.timestamp_utc = finished
            upsert_rows(out, [row])
            yield row

    return run_points


def test_ctrl_c_says_which_rows_were_kept_and_exits_130(tmp_path, monkeypatch):
    """Ctrl-C during the second of three points: one line naming the kept row and the file, the
    methods not measured, exit 130; the finished row is in the CSV."""
    out = tmp_path / "r.csv"
    monkeypatch.setattr(
        runner_package, "run_points", _stub_runner("a" * 40, "2025-01-01T00:00:00+00:00", interrupt_after=1)
    )
    result = runner.invoke(app, ["run", "--model", "tiny/qwen3", "--seq", "16", "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 130, result.output
    assert f"interrupted: 1 of 3 row(s) kept in {out} (bp); not measured: ckpt, streambp" in " ".join(
        result.output.split()
    )
    assert [r["method"] for r in read_rows(out)] == ["bp"]


def test_a_rerun_says_how_many_rows_it_replaced_and_from_when(tmp_path, monkeypatch):
    """Rows are upserted by point: a rerun names the rows it replaced (count, commit, time) and the
    rows of other points already in the file."""
    out = tmp_path / "r.csv"
    args = ["run", "--model", "tiny/qwen3", "--device", "cpu", "--method", "bp", "ckpt", "--out", str(out)]
    monkeypatch.setattr(runner_package, "run_points", _stub_runner("a" * 40, "2025-01-01T00:00:00+00:00"))
    first = runner.invoke(app, [*args, "--seq", "16"])
    assert first.exit_code == 0 and f"2 row(s) written to {out}" in first.output and "earlier" not in first.output
    monkeypatch.setattr(runner_package, "run_points", _stub_runner("b" * 40, "2025-02-02T00:00:00+00:00"))
    again = runner.invoke(app, [*args, "--seq", "16", "--method", "streambp"])
    line = " ".join(again.output.split())
    assert again.exit_code == 0
    assert f"3 row(s) written to {out}, 2 of them replacing rows of an earlier run (commit aaaaaaa, 2025-01-01" in line
    other = runner.invoke(app, [*args, "--seq", "32"])
    assert "; 3 row(s) of other points from earlier runs are also in it" in " ".join(other.output.split())
    assert len(read_rows(out)) == 5


@pytest.mark.parametrize(("load", "warned"), [(5.0, True), (1.5, False)])
def test_times_taken_under_load_are_marked_and_warned_under_the_table(tmp_path, monkeypatch, load, warned):
    """Rows timed at a load above the cores: their times carry † and a warning follows the results
    table, where it is read (the start's warning sees only the load before the first point)."""
    import sbpbench.cli.run_cmd as run_cmd

    monkeypatch.setattr(run_cmd, "busy_warning", lambda: None)  # this machine's own load is not the point
    timed = {"time_median_s": 1.5, "time_min_s": 1.4, "time_max_s": 1.6, "load_avg_1m": load, "num_threads": 2}
    monkeypatch.setattr(runner_package, "run_points", _stub_runner("a" * 40, "2025-01-01T00:00:00+00:00", **timed))
    argv = ["run", "--model", "tiny/qwen3", "--seq", "16", "--device", "cpu", "--method", "bp", "ckpt"]
    result = runner.invoke(app, [*argv, "--out", str(tmp_path / "r.csv")])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert ("1.500†" in text) is warned
    warning = "warning: 2 of 2 times taken at load above the cores (up to 5.0 on 2 threads), marked †"
    assert (warning in text) is warned
    if warned:  # after the table and its caption, before the line saying where the rows went
        assert text.index("1.500†") < text.index(warning) < text.index("row(s) written")


@pytest.mark.slow
def test_a_memory_limit_above_the_machine_runs_capped_at_its_ram_with_a_notice(tmp_path):
    """`sbp run --device cpu --model tiny/qwen3 --seq 64 --method bp --memory-limit 100TB`: an ok row
    whose recorded cap is this machine's RAM (beside the 100 TB asked for), and one notice line."""
    from sbpbench.measure.host_memory import total_ram_bytes

    out = tmp_path / "r.csv"
    argv = ["run", "--device", "cpu", "--model", "tiny/qwen3", "--seq", "64", "--method", "bp"]
    done = _run_sbp(*argv, "--memory-limit", "100TB", "--out", str(out))
    assert done.returncode == 0, done.stderr
    (row,) = read_rows(out)
    assert row["status"] == "ok" and row["memory_limit_bytes"] == str(100 * 10**12)
    assert row["memory_limit_effective_bytes"] == str(total_ram_bytes())
    notices = [line for line in done.stderr.splitlines() if line.startswith("notice:")]
    assert len(notices) == 1 and "this machine's RAM" in notices[0], done.stderr
    assert f"(ran at {total_ram_bytes() / 2**30:.2f})" in done.stdout  # the table's title says the cap it ran at
