"""The worker's memory numbers hang together and OOM is a result; on a CUDA GPU (gpu-marked), and the
same path on the CPU.

Every point here is measured in a worker process of its own (runner/isolated.py: a fresh
interpreter on a GPU), as `sbp run` measures it: in the pytest process the caching allocator keeps
the blocks of earlier tests, and the per-process cap is only checked when it asks the driver for
more, so a capped point could reuse cached blocks and come back ok instead of oom. Before each CUDA
worker the device must be free (device_free.py: a test before this one that kept its cache fails
it by name, instead of an OOM or a wrong NVML figure). One worker per method serves both the
memory-source and the ordering test (a module fixture). The CUDA cases are skipped without a GPU
(conftest.py); the CPU cases run the same isolated path.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sbpbench.config import RunSpec
from sbpbench.methods import MethodSettings
from sbpbench.records import ResultRow
from sbpbench.runner import run_isolated

from ..device_free import assert_device_free

MIB = 2**20
DEVICES = [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)]
# cuda: Qwen3-0.6B at T = 8192 in bf16 (weights + grads 2.2 GiB), capped at 4 GiB bp runs out of
# memory; cpu: tiny/qwen3 at T = 1024 (bp's activations about 27 MB), capped at 8 MB
POINTS = {
    "cuda": ({"model": "Qwen/Qwen3-0.6B", "seq_len": 8192, "dtype": "bf16", "device": "cuda"}, 2048, 4 * 2**30),
    "cpu": ({"model": "tiny/qwen3", "seq_len": 1024, "dtype": "fp32", "device": "cpu", "warmup": 0}, 128, 8 * MIB),
}


def _spec(device: str, method: str, **values) -> RunSpec:
    base, chunk, _ = POINTS[device]
    return RunSpec(method=method, settings=MethodSettings(chunk_size=chunk), **{"repeats": 1, **base, **values})


def _measure(device: str, method: str, **values) -> ResultRow:
    if device == "cuda":
        assert_device_free()
    return run_isolated(_spec(device, method, **values))


@pytest.fixture(scope="module")
def measured():
    """measured(device, method): the row of one isolated point (warm-up, memory step, one timed
    step), measured once per module."""
    rows: dict[tuple[str, str], ResultRow] = {}

    def row(device: str, method: str) -> ResultRow:
        if (device, method) not in rows:
            rows[device, method] = _measure(device, method)
        return rows[device, method]

    return row


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["bp", pytest.param("streambp", marks=pytest.mark.quick)])
def test_cuda_memory_sources_agree(measured, method):
    """allocated <= reserved, and NVML's device peak minus idle is the reserved peak plus the CUDA
    context, within 256 MiB or 5% (the allocator's memory is all NVML sees of this process besides
    its context)."""
    row = measured("cuda", method)
    assert row.status == "ok", row.error
    assert row.memory_source == "torch.cuda"
    assert row.baseline_bytes >= row.weights_bytes + row.grads_bytes
    assert row.peak_allocated_bytes <= row.peak_reserved_bytes
    nvml = row.nvml_peak_used_bytes - row.nvml_idle_used_bytes
    expected = row.peak_reserved_bytes + row.cuda_context_bytes
    print(f"{method}: nvml {nvml / MIB:.0f} MiB, reserved + context {expected / MIB:.0f} MiB")
    assert abs(nvml - expected) <= max(256 * MIB, 0.05 * expected)
    assert row.time_median_s > 0 and row.tflops_per_s > 0


@pytest.mark.parametrize("device", DEVICES)
def test_activation_peaks_are_ordered(measured, device):
    """bp keeps more activations than ckpt, ckpt more than streambp, each measured in its own process."""
    peaks = {m: measured(device, m).activation_peak_bytes for m in ("bp", "ckpt", "streambp")}
    print({m: f"{p / MIB:.1f} MiB" for m, p in peaks.items()})
    assert peaks["bp"] > peaks["ckpt"] > peaks["streambp"]


@pytest.mark.parametrize("device", DEVICES)
def test_memory_limit_gives_an_oom_row(device):
    """Capped (cuda: 4 GiB, weights and gradients take 2.2; cpu: 8 MB of tracked tensors), bp is an
    oom row, not a crash, and streambp under the same cap on the CPU fits; the cap is recorded as
    applied."""
    cap = POINTS[device][2]
    row = _measure(device, "bp", memory_limit=cap)
    assert row.status == "oom" and "OutOfMemoryError" in row.error, row.error
    assert row.memory_limit_bytes == row.memory_limit_effective_bytes == cap
    if device == "cpu":
        assert _measure(device, "streambp", memory_limit=cap, repeats=0).status == "ok"


def test_gpu_tests_measure_memory_in_their_own_process():
    """No gpu-marked test module measures a point with measure_point, in the pytest process, whose
    allocator cache the earlier tests filled: they go through run_isolated (or sbp's commands)."""
    for path in sorted(Path(__file__).parents[1].rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        source = path.read_text()
        if "pytest.mark.gpu" not in source:
            continue
        calls = [
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", "")) == "measure_point"
        ]
        assert not calls, f"{path.name} lines {calls}: measure in a worker process (runner.run_isolated)"
