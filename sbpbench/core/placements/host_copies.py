"""Copies between the device and host memory, as every offloading placement makes them
(placement.py, stream_store.py): on CUDA into page-locked buffers of the process's pool, on one side
stream, overlapping the compute stream's work; off a GPU, ordinary copies.

The orderings (core/README.md, "Where the checkpoints live"; checked on CPU by tests/cuda_standin.py):
- to the host: the side stream first waits for the work queued on the compute stream (it wrote the
  values), and `record_stream` keeps the values' memory from being reused before the copy is done;
- to the device: the target is allocated on the compute stream, the side stream waits for the work
  queued there (the memory's previous owner may still use it), copies, and records an event that
  the compute stream waits for before it reads the target (`arrive`);
- a host buffer goes back to the pool only once the host has waited for the last copy from or to it.
A (B, c, d) slice of a (B, T, d) host tensor is contiguous only for B = 1, so such a copy goes row
by row: a strided host copy would be made contiguous in pageable memory first, and synchronously.
"""

from __future__ import annotations

import torch

from ..cuda_calls import CudaCalls
from ..host_pool import HostBuffer
from ..phases import COPY_WAITS, HOST_COPIES, PhaseTimer, timed


class Copier:
    """The copies of one step. Counters: `to_device_bytes`, `to_host_bytes`; `pins_host_memory`
    (it took page-locked buffers) and `host_register_s` (seconds registering buffers the pool did not
    have). `timer` (phases.py), when set, times each copy on its stream and each wait for one."""

    def __init__(self, calls: CudaCalls):
        self.calls = calls
        self.timer: PhaseTimer | None = None
        self.to_device_bytes = self.to_host_bytes = 0
        self.pins_host_memory = False
        self.host_register_s = 0.0
        self._side = None  # the side stream, made on the first copy that needs one

    def overlaps(self, device: torch.device) -> bool:
        return self.calls.overlaps(device)

    def side_stream(self, device: torch.device):
        if self._side is None:
            self._side = self.calls.new_stream(device)
        return self._side

    def take_buffer(self, nbytes: int) -> HostBuffer:
        """A page-locked buffer of the pool (CUDA)."""
        self.pins_host_memory = True
        buffer, seconds = self.calls.pool.take(nbytes)
        self.host_register_s += seconds
        return buffer

    def give_buffer(self, buffer: HostBuffer, last_copy) -> None:
        """Back to the pool once the host knows `last_copy` (an event, or None) done."""
        if last_copy is not None:
            last_copy.synchronize()
        self.calls.pool.give(buffer)

    def to_host(self, host: torch.Tensor, values: torch.Tensor):
        """host (B, n, d) <- values on the device; returns the event after the copy (None off a GPU)."""
        self.to_host_bytes += values.nbytes
        if not self.overlaps(values.device):
            with timed(self.timer, HOST_COPIES):
                host.copy_(values)
            return None
        calls, side = self.calls, self.side_stream(values.device)
        side.wait_stream(calls.current_stream(values.device))  # the values are written
        with calls.use_stream(side), timed(self.timer, HOST_COPIES, side):
            _copy_rows(host, values)
            event = calls.new_event()
            event.record(side)
        calls.record_stream(values, side)  # its memory is not reused before the copy is done
        return event

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, object]:
        """A copy of host (B, n, d) on `device`, and the event the compute stream waits for before
        reading it (None off a GPU: the copy is done)."""
        self.to_device_bytes += host.nbytes
        if not self.overlaps(device):
            with timed(self.timer, HOST_COPIES):
                return host.to(device, copy=True), None
        calls, side = self.calls, self.side_stream(device)
        target = torch.empty(host.shape, dtype=host.dtype, device=device)  # on the compute stream
        side.wait_stream(calls.current_stream(device))  # the memory's previous owner is done with it
        with calls.use_stream(side):
            with timed(self.timer, HOST_COPIES, side):
                _copy_rows(target, host)
            event = calls.new_event()
            event.record(side)
        calls.record_stream(target, side)  # freed unread (an error): not reused before the copy is done
        return target, event

    def arrive(self, event, device: torch.device) -> None:
        """The compute stream waits for a copy to the device (`to_device`'s event)."""
        if event is not None:
            with timed(self.timer, COPY_WAITS):  # on the compute stream: how long it stood still
                self.calls.current_stream(device).wait_event(event)

    def synchronize(self) -> None:
        """The host waits for every copy queued so far."""
        if self._side is not None:
            self._side.synchronize()


class CopyCounters:
    """What a store's Copier (`self._copier`) counted, read as the store's own counters (placement.py
    CheckpointStore, stream_store.py StreamingStore), and the timer its copies report to."""

    _copier: Copier

    @property
    def timer(self) -> PhaseTimer | None:
        return self._copier.timer

    @timer.setter
    def timer(self, timer: PhaseTimer | None) -> None:
        self._copier.timer = timer

    @property
    def transfer_bytes(self) -> int:
        return self._copier.to_device_bytes + self._copier.to_host_bytes

    @property
    def pins_host_memory(self) -> bool:
        return self._copier.pins_host_memory

    @property
    def host_register_s(self) -> float:
        return self._copier.host_register_s


def _copy_rows(target: torch.Tensor, source: torch.Tensor) -> None:
    """target <- source, asynchronously: whole when both are contiguous, else row by row (each row of
    a (B, n, d) slice is)."""
    if target.is_contiguous() and source.is_contiguous():
        target.copy_(source, non_blocking=True)
        return
    for row in range(source.shape[0]):
        target[row].copy_(source[row], non_blocking=True)
