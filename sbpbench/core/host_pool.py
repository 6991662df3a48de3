"""Page-locked host buffers for the offloaded checkpoints, kept for the life of the process.

A checkpoint copied to the host on a side stream needs page-locked memory, or the copy is neither
asynchronous nor fast. Page-locking is slow (cudaHostRegister faults in and pins every page, at a
few GB/s: simulate/timing.py HOST_REGISTER_BYTES_S and its sources), so each buffer is registered once
and reused by every later step of the process: a training loop calling stream_backward, a measured
point's warm-up, memory and timed steps.

Why not torch's pinned allocator (`pin_memory=True`, CachingHostAllocator)? It rounds every block up
to a power of two (`PowerOf2Ceil` in CachingHostAllocatorImpl::allocate: a 4.5 GiB checkpoint pins
8 GiB), allocates with cudaHostAlloc under the driver's global lock unless
PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True is set, and caches freed blocks per
power-of-two size until `empty_cache`, so a loop whose T changes keeps every size it has seen. Its
register path does what this pool does per buffer: allocate, touch one byte per page from several
threads (cudaHostRegister would fault untouched pages in one by one, on one thread), then one
cudaHostRegister (allocWithCudaHostRegister). Here the same, at the exact page-rounded size: the
least bytes to register, registered once. (Not timed against them: a GPU row's host_register_s
will say what the registration costs.)

Policy, bounded when T changes between steps:
- a buffer serves a request of n bytes (rounded up to whole pages: `need`) when need <= its
  capacity < 2 x need, the smallest such first; the checkpoints of a step all have one size, so a
  step reuses what the previous step of a size within 2x registered;
- a miss first releases the free buffers (none of which fits), then registers one of `need` bytes;
- `trim()`, at the end of each step that used the pool, releases the free buffers that step did not
  take.
So after a step the pool holds only the buffers that step used, each under twice the bytes it
served: at most twice the step's host peak, plus a page per buffer. `release()` (the public
`release_pinned_memory`) frees them all.

Pages: each buffer is an allocation of its own whose registered range starts on a page and is whole
pages, so no two buffers share a page, however small (a page may be pinned once only; unregistering
one buffer must not unpin another's).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable

import torch

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096  # 4 KiB; 64 KiB on some ARM hosts

Register = Callable[[int, int], None]  # (address, bytes): page-lock, or raise HostMemoryError
Unregister = Callable[[int], None]  # (address)


class HostMemoryError(MemoryError):
    """Host memory for a checkpoint copy could not be allocated or page-locked: a host out of memory
    (a measured point's status oom), not a bug."""


def whole_pages(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


class HostBuffer:
    """`capacity` bytes of page-locked host memory: `pages` (uint8, page aligned) inside `raw`,
    the allocation that owns them (one page larger, for the alignment)."""

    def __init__(self, raw: torch.Tensor, capacity: int):
        offset = -raw.data_ptr() % PAGE_BYTES
        self.raw = raw
        self.pages = raw[offset : offset + capacity]
        self.capacity = capacity
        self.used = False  # taken or given back since the pool's last trim

    @property
    def address(self) -> int:
        return self.pages.data_ptr()

    def view(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The buffer's first bytes as a contiguous tensor of `shape` and `dtype`."""
        nbytes = math.prod(shape) * dtype.itemsize
        assert nbytes <= self.capacity, (nbytes, self.capacity)
        return self.pages[:nbytes].view(dtype).view(shape)


class HostBufferPool:
    """Buffers taken by a step (`take`), handed back when no copy uses them any more (`give`),
    kept for the next step. Thread-safe. Counters: `registered_bytes` (page-locked now),
    `num_registrations` (buffers registered so far), `in_use` (taken, not given back)."""

    def __init__(self, register: Register, unregister: Unregister):
        self._register, self._unregister = register, unregister
        self._free: list[HostBuffer] = []
        self._taken: set[HostBuffer] = set()
        self._lock = threading.Lock()
        self.registered_bytes = 0
        self.num_registrations = 0

    @property
    def in_use(self) -> int:
        return len(self._taken)

    def take(self, nbytes: int) -> tuple[HostBuffer, float]:
        """A buffer of at least nbytes, and the seconds spent allocating and page-locking it (0.0
        when a free one fits)."""
        need = whole_pages(nbytes)
        with self._lock:
            fits = [b for b in self._free if need <= b.capacity < 2 * need]
            if fits:
                buffer, stale = min(fits, key=lambda b: b.capacity), []
                self._free.remove(buffer)
            else:  # none fits: the free ones are released before a new one adds to the pinned bytes
                buffer, stale, self._free = None, self._free, []
        for old in stale:
            self._drop(old)
        seconds = 0.0
        if buffer is None:
            start = time.perf_counter()
            buffer = self._new(need)
            seconds = time.perf_counter() - start
        with self._lock:
            buffer.used = True
            self._taken.add(buffer)
        return buffer, seconds

    def give(self, buffer: HostBuffer) -> None:
        """Back to the pool. The caller has made sure no copy from or to it is in flight."""
        with self._lock:
            self._taken.remove(buffer)
            buffer.used = True
            self._free.append(buffer)

    def trim(self) -> None:
        """Release the free buffers not taken since the last trim (the end of a step that used the pool)."""
        with self._lock:
            stale = [b for b in self._free if not b.used]
            self._free = [b for b in self._free if b.used]
            for buffer in self._free + list(self._taken):
                buffer.used = False
        for buffer in stale:
            self._drop(buffer)

    def release(self) -> int:
        """Unregister and free every buffer not taken; the bytes released."""
        with self._lock:
            stale, self._free = self._free, []
        for buffer in stale:
            self._drop(buffer)
        return sum(b.capacity for b in stale)

    def _new(self, need: int) -> HostBuffer:
        try:
            raw = torch.empty(need + PAGE_BYTES, dtype=torch.uint8)
        except RuntimeError as error:  # torch's CPU allocator: "can't allocate memory"
            raise HostMemoryError(
                f"host memory: allocating {need / 2**30:.2f} GiB for a checkpoint copy failed: {error}"
            ) from error
        buffer = HostBuffer(raw, need)
        buffer.pages[::PAGE_BYTES].fill_(0)  # fault the pages in on torch's threads (see the module docstring)
        self._register(buffer.address, need)
        with self._lock:
            self.registered_bytes += need
            self.num_registrations += 1
        return buffer

    def _drop(self, buffer: HostBuffer) -> None:
        self._unregister(buffer.address)  # before the memory goes back to the allocator
        with self._lock:
            self.registered_bytes -= buffer.capacity
