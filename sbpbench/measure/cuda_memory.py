"""GPU memory of one step: the caching allocator's peaks (torch.cuda) and the device-level used
memory seen by the driver (pynvml), sampled by a thread every few milliseconds.

`max_memory_allocated` is what tensors held (the paper's numbers); `max_memory_reserved` adds
the allocator's cached, fragmented blocks; the NVML figure adds the CUDA context (kernels, cuBLAS
and cuDNN handles) and every other process on the device. NVML is read before this process first
touches CUDA, so the context's own size can be separated out.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Self

import torch

SAMPLE_PERIOD_S = 0.002  # fast enough for a step of seconds; an NVML query takes ~0.1 ms


def nvml_handle(device: torch.device):
    """The NVML handle of a CUDA device, or None without NVML. Honours CUDA_VISIBLE_DEVICES."""
    try:
        import pynvml
    except ImportError:
        return None
    index = device.index or 0
    # torch's private helper maps CUDA_VISIBLE_DEVICES to NVML's numbering; without it the logical
    # index is right whenever nothing is remapped
    to_nvml = getattr(torch.cuda, "_get_nvml_device_index", None)
    try:
        pynvml.nvmlInit()
        if to_nvml is not None:
            index = to_nvml(index)
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except (pynvml.NVMLError, RuntimeError, ValueError):
        return None


def nvml_used_bytes(handle) -> int | None:
    if handle is None:
        return None
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)


class NvmlPeakSampler:
    """with NvmlPeakSampler(handle) as sampler: step(); sampler.peak_bytes (None without NVML)."""

    def __init__(self, handle, period_s: float = SAMPLE_PERIOD_S):
        self.handle = handle
        self.period_s = period_s
        self.peak_bytes: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        used = nvml_used_bytes(self.handle)
        if used is not None:
            self.peak_bytes = used if self.peak_bytes is None else max(self.peak_bytes, used)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period_s)

    def __enter__(self) -> Self:
        if self.handle is not None:
            self._sample()
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            self._stop.set()
            self._thread.join()
            self._sample()


@dataclass(frozen=True)
class CudaStartup:
    """Device memory before and after this process created its CUDA context."""

    idle_used_bytes: int | None  # NVML used before this process touched the device
    context_bytes: int | None  # NVML used after init, minus idle, minus what the allocator reserved


def start_cuda(device: torch.device) -> CudaStartup:
    """Create the CUDA context (a tiny allocation plus a cuBLAS handle via one matmul) and measure it."""
    handle = nvml_handle(device)
    idle = nvml_used_bytes(handle)
    torch.cuda.set_device(device)
    x = torch.ones(8, 8, device=device)
    (x @ x).sum().item()  # loads kernels and creates the cuBLAS handle, as the first step would
    torch.cuda.synchronize(device)
    used = nvml_used_bytes(handle)
    context = None if idle is None else used - idle - torch.cuda.memory_reserved(device)
    return CudaStartup(idle, context)
