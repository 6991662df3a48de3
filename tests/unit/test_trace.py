"""Profiler traces (`sbp run --trace`, measure/trace.py and runner/traces.py): what the profiler is
asked to record on each device, and that a trace never costs the row."""

from __future__ import annotations

import json
import os

from torch.profiler import ProfilerAction, ProfilerActivity

from sbpbench.config import point_specs
from sbpbench.measure import trace
from sbpbench.records import ResultRow
from sbpbench.runner import traces


class StandInProfiler:
    """torch.profiler.profile as profile_step calls it: keeps its arguments, logs what happens in
    order, writes a trace with one marked step."""

    made: list[StandInProfiler] = []

    def __init__(self, log: list[str], **kwargs):
        self.log, self.kwargs, self.metadata = log, kwargs, {}
        StandInProfiler.made.append(self)

    def __enter__(self):
        self.log.append("start")
        return self

    def __exit__(self, *exc):
        self.log.append("stop")

    def add_metadata_json(self, key: str, value: str) -> None:
        self.metadata[key] = json.loads(value)

    def export_chrome_trace(self, path: str) -> None:
        event = {"name": "ProfilerStep#0", "cat": "user_annotation", "ph": "X"}
        with open(path, "w") as f:
            json.dump({**self.metadata, "traceEvents": [event]}, f)


def _profiled(tmp_path, device_type: str) -> tuple[StandInProfiler, list[str]]:
    log: list[str] = []
    StandInProfiler.made.clear()
    path = trace.profile_step(
        lambda: log.append("step"),
        tmp_path / "point" / "rank0.json",
        device_type=device_type,
        synchronize=lambda: log.append("sync"),
        profiler=lambda **kwargs: StandInProfiler(log, **kwargs),
    )
    assert path == tmp_path / "point" / "rank0.json" and json.loads(path.read_text())["distributedInfo"] == {"rank": 0}
    assert os.listdir(path.parent) == ["rank0.json"]  # written whole, no temporary file left
    return StandInProfiler.made[0], log


def test_the_profiler_records_cuda_kernels_only_on_a_cuda_device():
    """CPU ops always; CUDA activity (kernels, copies) is asked for on a cuda device, never elsewhere."""
    assert trace.profiler_activities("cuda") == [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    assert trace.profiler_activities("cpu") == [ProfilerActivity.CPU]


def test_a_cuda_step_is_profiled_with_cuda_activities_and_synchronised_inside(tmp_path):
    """On cuda (a stand-in profiler): CUDA activities, shapes without stacks, one marked step, and
    the step's kernels waited for inside the profiled region."""
    profiler, log = _profiled(tmp_path, "cuda")
    assert profiler.kwargs["activities"] == [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    assert profiler.kwargs["record_shapes"] is True and profiler.kwargs["with_stack"] is False
    schedule = profiler.kwargs["schedule"]
    assert [schedule(n) for n in range(2)] == [ProfilerAction.RECORD_AND_SAVE, ProfilerAction.NONE]
    assert log == ["sync", "start", "step", "sync", "stop"]


def test_a_cpu_step_asks_for_cpu_activity_alone(tmp_path):
    """On the CPU (the same stand-in) the profiler records CPU ops only."""
    profiler, _ = _profiled(tmp_path, "cpu")
    assert profiler.kwargs["activities"] == [ProfilerActivity.CPU]


def test_a_trace_that_fails_costs_the_trace_not_the_row(tmp_path, monkeypatch, capsys):
    """A profiler that raises leaves the row untouched, with no trace named, and the traceback on
    stderr; without a trace folder nothing runs at all."""
    (spec,) = point_specs({"model": "tiny/qwen3", "device": "cpu", "seq_len": 64}, ["bp"])
    row, steps = ResultRow(status="ok"), []

    def broken(*args, **kwargs):
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(traces, "profile_step", broken)
    traces.trace_step(spec, row, "cpu", steps.append, lambda: None, lambda: None)
    assert steps == [] and row.trace_file == ""  # no folder: no extra step
    with traces.tracing_into(tmp_path):
        traces.trace_step(spec, row, "cpu", steps.append, lambda: None, lambda: None)
    assert steps == [traces.TRACED_STEP] and row.trace_file == "" and row.status == "ok"
    assert "no profiler here" in capsys.readouterr().err
