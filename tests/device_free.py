"""Is the GPU free before a gpu-marked test measures memory in a worker process?

A worker's numbers (NVML's device peak minus idle, the allocator's peaks) are only right on a
device nothing else is filling: memory this pytest process still caches from the tests before it,
or another process, makes the worker run out of memory or NVML count it. So such a test checks
first, and a busy device fails it with a message naming what holds the memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

GIB = 2**30
# What an idle device may show in use: on one H100, NVML counts 0.48 GiB with no process on it and
# a CUDA context takes 0.67 GiB (this process's, once a test touched CUDA).
FREE_SLACK_BYTES = 2 * GIB
CUDA_0 = torch.device("cuda:0")  # the device a GPU test runs on unless told


@dataclass(frozen=True)
class DeviceUse:
    total_bytes: int
    used_bytes: int  # NVML: every process and the driver
    own_reserved_bytes: int  # this process's caching allocator (0 before it touches CUDA)
    own_allocated_bytes: int  # of that, live tensors
    processes: tuple[tuple[int, int | None], ...]  # NVML's compute processes: (pid, bytes or None)


def device_use(handle, nvml, cuda=torch.cuda, device: int = 0) -> DeviceUse:
    """The device's memory as NVML sees it (`nvml`: the pynvml module or a stand-in) beside what
    this process's allocator holds; `cuda` is torch.cuda or a stand-in, never initialised here."""
    info = nvml.nvmlDeviceGetMemoryInfo(handle)
    own = cuda.is_initialized()
    processes = tuple(
        (int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory))
        for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    )
    return DeviceUse(
        total_bytes=int(info.total),
        used_bytes=int(info.used),
        own_reserved_bytes=int(cuda.memory_reserved(device)) if own else 0,
        own_allocated_bytes=int(cuda.memory_allocated(device)) if own else 0,
        processes=processes,
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def busy_device_message(use: DeviceUse, *, own_pid: int, slack_bytes: int = FREE_SLACK_BYTES) -> str | None:
    """None when at most slack_bytes are in use; else one message: how much is used, what this
    process's allocator holds and which processes NVML lists."""
    if use.used_bytes <= slack_bytes:
        return None
    parts = [f"device not free before measuring: NVML sees {_gib(use.used_bytes)} of {_gib(use.total_bytes)} in use"]
    parts[0] += f" (at most {_gib(slack_bytes)} expected)"
    if use.own_reserved_bytes:
        parts.append(
            f"this pytest process (pid {own_pid}) caches {_gib(use.own_reserved_bytes)} in torch's allocator, "
            f"{_gib(use.own_allocated_bytes)} of it live tensors: a test before this one kept them "
            "(tests/conftest.py releases the cache after each gpu-marked test)"
        )
    others = [
        f"pid {pid}{' (this process)' if pid == own_pid else ''}: {'?' if used is None else _gib(used)}"
        for pid, used in use.processes
    ]
    parts.append("processes on the device: " + (", ".join(others) if others else "none listed by NVML"))
    parts.append("a worker measured now would run out of memory or count theirs: free it, or run this test alone")
    return "; ".join(parts)


def assert_device_free(device: torch.device = CUDA_0, *, handle=None, nvml=None, cuda=None) -> None:
    """Fail with busy_device_message when the device is not free; handle, nvml and cuda default to
    NVML's handle of `device`, pynvml and torch.cuda (no check without NVML)."""
    if nvml is None:
        from sbpbench.measure.cuda_memory import nvml_handle

        handle = nvml_handle(device)
        if handle is None:
            return
        import pynvml as nvml
    use = device_use(handle, nvml, cuda or torch.cuda, device=device.index or 0)
    message = busy_device_message(use, own_pid=os.getpid())
    assert message is None, message
