"""On a CUDA GPU: the worker's memory numbers hang together and OOM is a result.

Skipped without a GPU (conftest.py).
"""

from __future__ import annotations

import pytest

from sbpbench.config import RunSpec
from sbpbench.methods import MethodSettings
from sbpbench.runner.point import measure_point

pytestmark = pytest.mark.gpu

MIB = 2**20


def _spec(method: str, **values) -> RunSpec:
    base = {"model": "Qwen/Qwen3-0.6B", "seq_len": 8192, "dtype": "bf16", "device": "cuda", "repeats": 2}
    return RunSpec(method=method, settings=MethodSettings(chunk_size=2048), **(base | values))


@pytest.mark.parametrize("method", ["bp", "streambp"])
def test_cuda_memory_sources_agree(method):
    """allocated <= reserved, and NVML's device peak minus idle is the reserved peak plus the CUDA
    context, within 256 MiB or 5% (the allocator's memory is all NVML sees of this process besides
    its context)."""
    row = measure_point(_spec(method))
    assert row.status == "ok", row.error
    assert row.memory_source == "torch.cuda"
    assert row.baseline_bytes >= row.weights_bytes + row.grads_bytes
    assert row.peak_allocated_bytes <= row.peak_reserved_bytes
    nvml = row.nvml_peak_used_bytes - row.nvml_idle_used_bytes
    expected = row.peak_reserved_bytes + row.cuda_context_bytes
    print(f"{method}: nvml {nvml / MIB:.0f} MiB, reserved + context {expected / MIB:.0f} MiB")
    assert abs(nvml - expected) <= max(256 * MIB, 0.05 * expected)
    assert row.time_median_s > 0 and row.tflops_per_s > 0


def test_cuda_activation_peaks_are_ordered():
    peaks = {m: measure_point(_spec(m, repeats=1)).activation_peak_bytes for m in ("bp", "ckpt", "streambp")}
    print({m: f"{p / MIB:.0f} MiB" for m, p in peaks.items()})
    assert peaks["bp"] > peaks["ckpt"] > peaks["streambp"]


def test_cuda_memory_limit_gives_an_oom_row():
    """Capped at 4 GiB (weights + grads of Qwen3-0.6B in bf16 take 2.2 GiB), bp at T=8192 is oom, not a crash."""
    row = measure_point(_spec("bp", memory_limit=4 * 2**30, repeats=1))
    assert row.status == "oom" and "OutOfMemoryError" in row.error
