"""`sbp run --trace`: a PyTorch profiler trace of one step after the timed ones, in a folder per
point beside the CSV, named by the row; the worker's own code runs in this process."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sbpbench.cli import app
from sbpbench.records import ResultRow, read_rows
from sbpbench.runner import isolated, worker

runner = CliRunner()
POINT = ["run", "--model", "tiny/qwen3", "--device", "cpu", "--seq", "64", "--warmup", "0", "--threads", "1"]


@pytest.fixture
def worker_in_process(monkeypatch):
    """Each point's worker (runner/worker.py run_point) run in this process, from the request the
    parent sends it, so the trace folder crosses the request as it does to a real worker."""
    monkeypatch.setattr(worker, "die_with_parent", lambda: None)

    def run_workers(spec, tmp, timeline_dir=None, trace_dir=None):
        result = tmp / "result.json"
        assert worker.run_point(worker.request_json(spec, timeline_dir, trace_dir), result) == 0
        return ResultRow(**json.loads(result.read_text())), ""

    monkeypatch.setattr(isolated, "_run_workers", run_workers)


def test_a_traced_run_writes_a_chrome_trace_and_names_it_in_the_row(tmp_path, worker_in_process):
    """--trace --repeats 1: the row names traces/<point>/rank0.json, relative to the CSV, whose
    traceEvents hold aten ops and one ProfilerStep marker, with the rank HTA needs; streambp's
    phase columns still come from its timed step, so the traced step ran outside the timed ones."""
    out = tmp_path / "runs.csv"
    result = runner.invoke(app, [*POINT, "--repeats", "1", "--method", "streambp", "--trace", "--out", str(out)])
    assert result.exit_code == 0, result.output
    (row,) = read_rows(out)
    name = row["trace_file"]
    assert name.startswith("traces/") and name.endswith("/rank0.json"), name
    assert f"streambp: trace {tmp_path / name}" in " ".join(result.output.split())
    with (tmp_path / name).open() as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    assert isinstance(events, list) and trace["distributedInfo"] == {"rank": 0}
    assert sum(e.get("cat") == "cpu_op" and e["name"].startswith("aten::") for e in events) > 100
    assert [e["name"] for e in events if e.get("name", "").startswith("ProfilerStep")] == ["ProfilerStep#0"]
    assert row["phase_head_s"] and row["time_median_s"]


def test_a_point_without_timed_steps_is_not_traced_and_says_so_once(tmp_path, worker_in_process):
    """--repeats 0: no trace folder, no trace named in any row, and one notice for all methods."""
    out = tmp_path / "runs.csv"
    result = runner.invoke(app, [*POINT, "--repeats", "0", "--method", "bp", "ckpt", "--trace", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert text.count("no trace") == 1 and "no trace for bp, ckpt: --repeats 0 runs no timed step" in text
    assert [row["trace_file"] for row in read_rows(out)] == ["", ""]
    assert not (tmp_path / "traces").exists()


def test_a_trace_of_several_ranks_is_refused_before_anything_runs(tmp_path):
    """--trace --nproc 2: one error naming the flag, and no results file."""
    out = tmp_path / "runs.csv"
    result = runner.invoke(app, [*POINT, "--nproc", "2", "--method", "bp", "--trace", "--out", str(out)])
    assert result.exit_code != 0 and "--trace records one process's step" in " ".join(result.output.split())
    assert not out.exists()
