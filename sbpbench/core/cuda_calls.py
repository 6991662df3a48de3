"""The CUDA calls a CheckpointStore (placement.py) and a PhaseTimer (phases.py) make, in one object:
side streams, events, `record_stream`, one synchronize, page-locking host memory, and the pool of
page-locked buffers (host_pool.py).

`CUDA_CALLS` is the process's: its pool lives as long as the process, so every step after the first
reuses the buffers the first registered. `release_pinned_memory()` gives them back. Tests pass a
recording stand-in with the same methods (tests/cuda_standin.py), which runs the store's CUDA branch
on CPU tensors and checks its ordering.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from .host_pool import HostBufferPool, HostMemoryError

CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation


class CudaCalls:
    """The runtime as the store uses it. Streams and events are torch.cuda's (the store calls their
    wait_stream / wait_event / record / synchronize methods)."""

    def __init__(self) -> None:
        self.pool = HostBufferPool(self.host_register, self.host_unregister)

    def overlaps(self, device: torch.device) -> bool:
        """Copies to and from `device` run on a side stream into page-locked host buffers."""
        return device.type == "cuda"

    def runs_async(self, device: torch.device) -> bool:
        """Work on `device` is queued on streams and runs after the host moves on: timed by events."""
        return device.type == "cuda"

    def new_stream(self, device: torch.device):
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def use_stream(self, stream) -> AbstractContextManager:
        return torch.cuda.stream(stream)

    def new_event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def host_register(self, address: int, nbytes: int) -> None:
        """Page-lock [address, address + nbytes); a shortage of host memory is a HostMemoryError."""
        error = self.cuda_host_register(address, nbytes)
        if not error:
            return
        self.clear_pending_error()
        if error == CUDA_ERROR_MEMORY_ALLOCATION:
            raise HostMemoryError(
                f"host memory: page-locking {nbytes / 2**30:.2f} GiB for a checkpoint copy failed "
                f"(cudaHostRegister: cudaErrorMemoryAllocation): free host memory, or keep fewer layer "
                f"inputs on the host (cpu+recompute:K)"
            )
        raise RuntimeError(f"cudaHostRegister of {nbytes:,} B at {address:#x} failed: cudaError {error}")

    def host_unregister(self, address: int) -> None:
        error = self.cuda_host_unregister(address)
        if error:
            self.clear_pending_error()
            raise RuntimeError(f"cudaHostUnregister at {address:#x} failed: cudaError {error}")

    # the runtime itself: a cudaError_t each (0: success)

    def cuda_host_register(self, address: int, nbytes: int) -> int:
        return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))

    def cuda_host_unregister(self, address: int) -> int:
        return int(torch.cuda.cudart().cudaHostUnregister(address))

    def clear_pending_error(self) -> None:
        """A failed cudaHostRegister leaves its error pending on the thread, where the next kernel
        launch check would raise it against an unrelated call (vllm-project/vllm#51081). torch
        exposes no cudaGetLastError; a one-element kernel's launch check reads, and so clears, it."""
        try:
            torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
        except RuntimeError:
            pass


CUDA_CALLS = CudaCalls()


def release_pinned_memory() -> int:
    """Unregister and free the page-locked host buffers StreamBP keeps between steps
    (stream_backward with an offloading `checkpoints` placement on CUDA); returns the bytes freed.
    Buffers of a step still running are left to it. The next offloading step registers anew."""
    return CUDA_CALLS.pool.release()
