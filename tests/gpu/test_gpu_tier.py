"""The gpu-marked tier's own machinery, on a CPU: the device released after each gpu test, the
device-free check before a memory worker, each test's outcome recorded as it finishes (so a cut
run keeps its messages), and the GPU tests' code itself, run on a CPU stand-in (tiny shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sbpbench.runner.selftest_summary import TEST_REPORT_ENV, read_test_report

from .. import conftest
from ..cuda_standin import FakeCudaMemory, FakeNvml
from ..device_free import GIB, assert_device_free, busy_device_message, device_use
from . import test_gpu, test_gpu_kernels, test_gpu_measure, test_gpu_stream


class _Item:
    """A collected test as the teardown hook sees it: its markers."""

    def __init__(self, *markers: str):
        self.markers = markers

    def get_closest_marker(self, name):
        return name if name in self.markers else None


def _teardown(item) -> None:
    """Drive conftest's teardown wrapper around a teardown that does nothing."""
    wrapper = conftest.pytest_runtest_teardown(item, None)
    next(wrapper)
    with pytest.raises(StopIteration):
        wrapper.send(None)


def test_gpu_tests_release_the_device_after_their_teardown(monkeypatch, request):
    """After a gpu-marked test (not after others) the hook registered in this session drops the
    last failure's frames and empties torch's cache; an uninitialised CUDA is never initialised."""
    assert conftest.pytest_runtest_teardown in [
        impl.function for impl in request.config.pluginmanager.hook.pytest_runtest_teardown.get_hookimpls()
    ]
    cuda = FakeCudaMemory(reserved=58 * GIB, allocated=GIB)
    monkeypatch.setattr(torch.cuda, "is_initialized", cuda.is_initialized)
    monkeypatch.setattr(torch.cuda, "empty_cache", cuda.empty_cache)
    monkeypatch.setattr(sys, "last_traceback", object(), raising=False)
    _teardown(_Item())
    assert cuda.empty_cache_calls == 0 and sys.last_traceback is not None
    _teardown(_Item("gpu"))
    assert cuda.empty_cache_calls == 1 and cuda.reserved == GIB and sys.last_traceback is None
    conftest.release_device_memory(FakeCudaMemory(initialized=False))  # its empty_cache would assert


def _use(**values) -> dict:
    return {"total": 80 * GIB, "used": int(0.5 * GIB), "processes": (), **values}


def test_a_free_device_passes_the_check():
    """An idle device (the driver's half GiB, this process's context) is free."""
    nvml = FakeNvml(**_use(used=int(1.2 * GIB), processes=[(os.getpid(), int(0.7 * GIB))]))
    assert_device_free(handle=object(), nvml=nvml, cuda=FakeCudaMemory(reserved=0))


def test_a_busy_device_fails_the_check_naming_what_holds_it():
    """A cache this process kept and another process on the device: the check fails before any
    worker starts, with both named and their sizes."""
    nvml = FakeNvml(**_use(used=62 * GIB, processes=[(os.getpid(), 59 * GIB), (4242, 2 * GIB), (7, None)]))
    with pytest.raises(AssertionError) as failure:
        assert_device_free(handle=object(), nvml=nvml, cuda=FakeCudaMemory(reserved=58 * GIB, allocated=GIB))
    message = str(failure.value)
    assert "62.00 GiB of 80.00 GiB in use" in message
    assert f"this pytest process (pid {os.getpid()}) caches 58.00 GiB" in message and "1.00 GiB of it live" in message
    assert "pid 4242: 2.00 GiB" in message and "pid 7: ?" in message


def test_another_process_alone_is_named():
    """Nothing cached here (CUDA never initialised): only the other process is named."""
    nvml = FakeNvml(**_use(used=30 * GIB, processes=[(99, 29 * GIB)]))
    use = device_use(object(), nvml, FakeCudaMemory(initialized=False))
    message = busy_device_message(use, own_pid=1)
    assert "pytest process" not in message and "pid 99: 29.00 GiB" in message


class _Report:
    """What pytest hands pytest_runtest_logreport."""

    def __init__(self, nodeid, when, outcome, longrepr=None, duration=1.25):
        self.nodeid, self.when, self.outcome, self.longrepr, self.duration = nodeid, when, outcome, longrepr, duration
        self.failed, self.skipped = outcome == "failed", outcome == "skipped"

    @property
    def longreprtext(self) -> str:
        return str(self.longrepr)


def test_each_test_is_recorded_as_it_finishes(tmp_path, monkeypatch):
    """With TEST_REPORT_ENV set, collection, each start and each result are JSON lines on disk at
    once; read back, a failure keeps its message, a skip its reason, a failing teardown after a
    passing call counts as an error, and the test started last without a result was cut."""
    path = tmp_path / "tests.jsonl"
    monkeypatch.setenv(TEST_REPORT_ENV, str(path))

    class Session:
        items = [type("Item", (), {"nodeid": f"t.py::{n}"})() for n in ("a", "b", "c", "d", "e")]

    conftest.pytest_collection_finish(Session)
    failure = "t.py:3: in b\n    assert x\nE   AssertionError: loss rel error 1.9e-4\nE   assert False"
    events = [
        ("a", [_Report("t.py::a", "call", "passed")]),
        ("b", [_Report("t.py::b", "setup", "passed"), _Report("t.py::b", "call", "failed", failure)]),
        ("c", [_Report("t.py::c", "setup", "skipped", ("t.py", 9, "needs a CUDA GPU"))]),
        ("d", [_Report("t.py::d", "call", "passed"), _Report("t.py::d", "teardown", "failed", "E   OSError")]),
        ("e", []),  # killed while running
    ]
    for name, reports in events:
        conftest.pytest_runtest_logstart(f"t.py::{name}", None)
        for report in reports:
            conftest.pytest_runtest_logreport(report)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 1 + 5 + 5  # collected, five starts, five results (the passing set-up is not one)
    report = read_test_report(path.read_text() + '{"event": "result", "te')  # a torn last line
    assert report.counts() == {"PASSED": 1, "FAILED": 1, "SKIPPED": 1, "ERROR": 1}
    assert report.running == "t.py::e" and report.not_reached == []
    failed = {r["test"]: r for r in report.failed()}
    assert "AssertionError: loss rel error 1.9e-4" in failed["t.py::b"]["message"]
    assert failed["t.py::d"]["when"] == "teardown"
    assert report.results["t.py::c"]["message"] == "needs a CUDA GPU"


@pytest.mark.slow
def test_a_killed_pytest_run_keeps_what_finished(tmp_path):
    """A real pytest run with this conftest, killed in its third test: the report on disk has the
    pass, the failure with its message, and the test in flight; the fourth was never reached."""
    (tmp_path / "test_cut.py").write_text(
        "import time\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert 1 == 2, 'the message'\n"
        "def test_hangs(): time.sleep(600)\n"
        "def test_after(): pass\n"
    )
    path = tmp_path / "tests.jsonl"
    repository = Path(__file__).resolve().parents[2]
    env = {**os.environ, TEST_REPORT_ENV: str(path), "PYTHONPATH": str(repository)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider", str(tmp_path)]
    process = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while process.poll() is None and time.monotonic() < deadline:  # until test_hangs has started
            if path.exists() and (read_test_report(path.read_text()).running or "").endswith("test_hangs"):
                break
            time.sleep(0.05)
    finally:
        process.kill()
        process.wait()
    report = read_test_report(path.read_text())
    assert report.counts() == {"PASSED": 1, "FAILED": 1}
    assert "the message" in report.failed()[0]["message"]
    assert report.running.endswith("test_hangs") and [t.split("::")[1] for t in report.not_reached] == ["test_after"]


def test_the_gpu_tests_run_on_a_cpu_stand_in(monkeypatch):
    """test_gpu.py's tests, their shared fp64 step and their judging, on the CPU with a tiny shape and
    short sequences: the code a GPU runs is exercised here (the CUDA kernels are not)."""
    monkeypatch.setattr(test_gpu, "DEVICE", "cpu")
    monkeypatch.setattr(test_gpu, "SEQ_LEN", 40)
    monkeypatch.setattr(test_gpu, "SETTINGS", test_gpu.MethodSettings(chunk_size=13, logits_chunk_size=9))
    monkeypatch.setattr(test_gpu, "SHAPES", {"tiny/qwen3": {}})
    monkeypatch.setattr(test_gpu, "OBJECTIVE_SHAPE", ("tiny/qwen3", {}))
    monkeypatch.setattr(test_gpu, "OBJECTIVE_SEQ_LEN", 32)
    monkeypatch.setattr(test_gpu, "OBJECTIVE_SETTINGS", test_gpu.MethodSettings(chunk_size=7, logits_chunk_size=5))
    shape = test_gpu.build_shape("tiny/qwen3")
    before = {n: t.clone() for n, t in [*shape.model.named_parameters(), *shape.model.named_buffers()]}
    test_gpu.test_cuda_fp32_methods_match_bp(shape)
    test_gpu.test_cuda_bf16_streambp_error_is_bp_error(shape)
    after = dict([*shape.model.named_parameters(), *shape.model.named_buffers()])
    for name, value in before.items():  # the model as the next test expects it: fp32, rotary buffers unrounded
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name
    for objective in ("grpo", "dpo"):
        test_gpu.test_cuda_fp32_objectives_match_bp(objective, lora=False)
    test_gpu.test_cuda_fp32_objectives_match_bp("dpo", lora=True)


def test_a_cuda_memory_worker_starts_only_after_the_device_check(monkeypatch):
    """test_gpu_measure.py checks that the device is free before each CUDA worker (not before a
    CPU one), and a busy device stops it before the worker starts."""
    calls = []
    # RunSpec refuses cuda on a machine without one: the spec is a stand-in too
    monkeypatch.setattr(test_gpu_measure, "_spec", lambda device, method, **values: SimpleNamespace(device=device))
    monkeypatch.setattr(
        test_gpu_measure, "run_isolated", lambda spec, timeline_dir=None: calls.append(("worker", spec.device))
    )
    monkeypatch.setattr(test_gpu_measure, "assert_device_free", lambda: calls.append(("check",)))
    test_gpu_measure._measure("cuda", "bp")
    test_gpu_measure._measure("cpu", "bp")
    assert calls == [("check",), ("worker", "cuda"), ("worker", "cpu")]

    def busy():
        raise AssertionError("device not free before measuring")

    monkeypatch.setattr(test_gpu_measure, "assert_device_free", busy)
    with pytest.raises(AssertionError, match="not free"):
        test_gpu_measure._measure("cuda", "streambp")
    assert len(calls) == 3


def test_the_stream_and_timer_tests_run_on_a_cpu_stand_in(monkeypatch):
    """test_gpu_stream.py's checks on the CPU with tiny shapes: the stream placements against gpu's,
    and the phase times against the step's (the host's clock there, not CUDA events)."""
    monkeypatch.setattr(test_gpu_stream, "DEVICE", "cpu")
    monkeypatch.setattr(test_gpu_stream, "TIMED_MODEL", "tiny/qwen3")
    monkeypatch.setattr(test_gpu_stream, "TIMED_SEQ_LEN", 512)
    monkeypatch.setattr(test_gpu_stream, "TIMED_CHUNK", 128)
    monkeypatch.setattr(test_gpu_stream, "TIMED_LOGITS_CHUNK", 100)
    for placement, batch_size in test_gpu_stream.STREAMS:
        test_gpu_stream.test_cuda_stream_placement_gives_gpu_gradients(placement, batch_size)
    test_gpu_stream.test_cuda_phase_times_add_up_to_the_step()


def test_the_kernel_tests_run_on_a_cpu_stand_in(monkeypatch):
    """test_gpu_kernels.py on the CPU at fewer heads and positions: the shifted mask fails the bound,
    the split (the CPU flash kernel's halves) passes it, and the GPU-only kernels skip with a reason."""
    for name, value in {"DEVICE": "cpu", "HEADS": 8, "KV_HEADS": 2, "QUERIES": 100, "KEYS": 400}.items():
        monkeypatch.setattr(test_gpu_kernels, name, value)
    judged = test_gpu_kernels.judged.__wrapped__()
    test_gpu_kernels.test_a_mask_shifted_by_one_key_fails_the_bound(judged)
    test_gpu_kernels.test_each_attention_kernel_matches_the_reference(judged, "split")
    for name in ("flex", "fa3", "fa4"):
        with pytest.raises(pytest.skip.Exception, match=name):
            test_gpu_kernels.test_each_attention_kernel_matches_the_reference(judged, name)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_gpu_method_tests_the_measure_worker_and_check_pin_the_lower_right_kernel(tmp_path, dtype):
    """tests/gpu's method tests, the measure worker's StreamBP spec and `sbp check` (its rows' settings,
    in fp32 and bf16) run the chunk attention on the lower-right reference: none reads a table of
    measured kernels or compiles one; the kernels have their own tests."""
    from sbpbench.config import exactness_specs
    from sbpbench.core.internal import LOWER_RIGHT
    from sbpbench.records.exactness import read_exactness
    from sbpbench.runner.exactness import ExactnessSpec, check_exactness

    assert test_gpu.SETTINGS.chunk_attention == LOWER_RIGHT == test_gpu.OBJECTIVE_SETTINGS.chunk_attention
    assert test_gpu_measure._spec("cpu", "streambp").settings.chunk_attention == LOWER_RIGHT
    values = {"model": "tiny/qwen3", "seq_len": 16, "dtype": dtype, "chunk_size": 5, "device": "cpu"}
    out = tmp_path / "exactness.csv"
    specs = exactness_specs(values, ["streambp"])
    assert specs[-1].settings.chunk_attention == "auto"  # as given: the check pins it
    check_exactness(ExactnessSpec(tuple(specs), out=out))
    (row,) = read_exactness(out)
    assert row["method"] == "streambp" and f"chunk_attention={LOWER_RIGHT}" in row["settings"]
