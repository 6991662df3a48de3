"""`sbp run --trace` through real worker processes: the trace folder crosses the worker's request and
the profiler runs in the worker (a fork of the fork server on the CPU)."""

from __future__ import annotations

import json

import pytest

from sbpbench.config import RunSpec
from sbpbench.records import read_rows
from sbpbench.runner import run_points


@pytest.mark.slow
def test_a_worker_traces_one_step_beside_the_csv(tmp_path):
    """A bp point measured in its own process with trace=True: its row, in the CSV, names a trace
    beside it that json.load reads, with aten ops and one ProfilerStep marker."""
    out = tmp_path / "runs.csv"
    spec = RunSpec(method="bp", model="tiny/qwen3", seq_len=64, warmup=0, repeats=1, threads=1)
    (row,) = run_points([spec], out, trace=True)
    assert row.status == "ok", row.error
    assert [r["trace_file"] for r in read_rows(out)] == [row.trace_file] and row.trace_file.startswith("traces/")
    with (tmp_path / row.trace_file).open() as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "cpu_op" and e["name"] == "aten::mm" for e in events)
    assert sum(e.get("name", "").startswith("ProfilerStep#") for e in events) == 1
