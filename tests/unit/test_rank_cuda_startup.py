"""A CUDA rank's start (runner/point.py) on CPU stand-ins: NVML's idle reading of the rank's GPU
comes before anything makes the rank's CUDA context. CUDA 12's cudaSetDevice makes the context on
any GPU but the current one, so a rank that joined first (ranks.join's set_device) would record
its own context as the GPU's idle memory, and a context of about nothing."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from sbpbench.config import RunSpec
from sbpbench.measure.cuda_memory import CudaStartup
from sbpbench.runner import point
from tests.cuda_standin import FakeNvml

GIB = 2**30
IDLE, CONTEXT = 3 * GIB, GIB // 2  # another process's memory on the GPU; a CUDA context


class _Built(Exception):
    """Raised where the step would be built: the start is what is checked."""


def test_a_cuda_ranks_idle_reading_comes_before_its_context(monkeypatch):
    """Rank 1 of a point on cuda:0 (so on cuda:1) records NVML's idle bytes without its own context,
    and the context apart, as a one-process point does."""
    gpu = FakeNvml(total=80 * GIB, used=IDLE)  # rank 1's GPU, as NVML sees it
    contexts = []

    def set_device(device):  # CUDA 12: the first cudaSetDevice to a GPU makes its context there
        if device not in contexts:
            contexts.append(device)
            gpu.used += CONTEXT

    def start_cuda(device):  # measure/cuda_memory.py's reading, against the stand-in
        idle = gpu.used
        torch.cuda.set_device(device)
        return CudaStartup(idle, gpu.used - idle)

    def build_step(spec, row, device, rank):
        raise _Built("the step")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=gpu.total))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: None)
    monkeypatch.setattr(point, "start_cuda", start_cuda)
    monkeypatch.setattr(point, "build_step", build_step)
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    spec = RunSpec(model="tiny/qwen3", method="streambp", seq_len=64, device="cuda:0", nproc=2)

    row = point._measure(spec, None)

    assert row.device == "cuda:1" and contexts == [torch.device("cuda", 1)]
    assert row.error == "_Built: the step", row.error  # it got as far as the step
    assert (row.nvml_idle_used_bytes, row.cuda_context_bytes) == (IDLE, CONTEXT)
