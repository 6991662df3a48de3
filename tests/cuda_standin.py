"""A recording stand-in for the CUDA calls a CheckpointStore makes (core/cuda_calls.py): the real
store runs its CUDA branch (side stream, events, record_stream, page-locked buffers from its pool)
on CPU tensors, and every ordering it relies on is checked.

Streams follow vector clocks. Each fake stream counts the operations queued on it and knows, per
other stream, up to which of that stream's operations the work is certainly done before its own
next one: wait_event / wait_stream raise that; so does whatever the host has waited for
(Event.synchronize, Stream.synchronize), since the host queues later work after it. Inside
`tracking()` a TorchDispatchMode queues every aten op on the current stream (the default stream,
or a side stream inside `use_stream`) and, for every storage a side stream has touched, keeps each
stream's last read and last write. Before a side stream first touches a storage, the default stream
may have written it up to its latest op (its allocation, its producer), so the side stream must have
waited for that. Violations, in `violations`:
- race: an op reads what another stream wrote, or writes what another stream read or wrote,
  without knowing that access done (a copy back read before its wait; a copy out started before
  the compute that wrote its source);
- host: a host buffer handed back to the pool, or unregistered, while a copy from or to it is not
  known done by the host;
- free: a device storage a side stream used is freed while the default stream (which allocated it,
  and whose allocator would hand its memory out again at once) does not know that use done, and no
  record_stream names the side stream;
- register: a registration not page aligned, not whole pages, or overlapping another; an
  unregister of an address not registered;
- timing: an event's elapsed time read before the host knows both events done, or between events
  of two streams, or of an event made without timing.
Timing events (a PhaseTimer's, core/phases.py) read one millisecond per op queued between them on
their stream, so a phase's time counts its ops. `synchronizes` counts device-wide synchronizes,
`host_waits` every wait of the host (device, stream or event).
`drop` swallows one call (DROPPABLE): a store with that wait removed, which the checks must catch;
with `drop_at`, only the drop_at-th such call (from 0), one wait removed; `calls` counts them.

Below, stand-ins for the device-memory calls the gpu-marked tests' own machinery makes
(tests/conftest.py's release after each test, tests/device_free.py's check before a worker):
FakeCudaMemory for torch.cuda's caching allocator, FakeNvml for pynvml's device and process view.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sbpbench.core import stream as stream_module
from sbpbench.core.cuda_calls import CudaCalls
from sbpbench.core.host_pool import PAGE_BYTES, HostBuffer, HostBufferPool
from sbpbench.core.placements.placement import CheckpointStore
from sbpbench.core.placements.stream_store import StreamingStore

DROPPABLE = (
    "wait_event",
    "wait_stream",
    "event_synchronize",
    "stream_synchronize",
    "device_synchronize",
    "record_stream",
)

Clock = dict[int, int]  # stream id -> the last of its operations known done


def _merge(into: Clock, other: Clock) -> None:
    for stream, position in other.items():
        if into.get(stream, 0) < position:
            into[stream] = position


class FakeStream:
    def __init__(self, calls: RecordingCalls, ident: int):
        self.calls, self.ident = calls, ident
        self.clock: Clock = {ident: 0}

    def queue(self) -> int:
        """One more operation on this stream; its position. Queued now, it comes after whatever the
        host knows done."""
        _merge(self.clock, self.calls.host)
        self.clock[self.ident] += 1
        return self.clock[self.ident]

    def wait_stream(self, other: FakeStream) -> None:
        if not self.calls.dropped("wait_stream"):
            _merge(self.clock, other.clock)

    def wait_event(self, event: FakeEvent) -> None:
        if not self.calls.dropped("wait_event") and event.clock is not None:
            _merge(self.clock, event.clock)

    def synchronize(self) -> None:
        self.calls.host_waits.append("stream")
        if not self.calls.dropped("stream_synchronize"):
            _merge(self.calls.host, self.clock)


class FakeEvent:
    def __init__(self, calls: RecordingCalls, timing: bool = False):
        self.calls, self.timing = calls, timing
        self.clock: Clock | None = None  # what is done when the event completes
        self.stream: int | None = None  # the stream it was recorded on

    def record(self, stream: FakeStream) -> None:
        _merge(stream.clock, self.calls.host)
        self.clock = dict(stream.clock)
        self.stream = stream.ident
        if self.timing:
            self.calls.timing_events.append(self)

    @property
    def position(self) -> int:
        """The ops its stream had queued when it was recorded."""
        return self.clock[self.stream]

    def synchronize(self) -> None:
        self.calls.host_waits.append("event")
        if not self.calls.dropped("event_synchronize") and self.clock is not None:
            _merge(self.calls.host, self.clock)

    def elapsed_time(self, end: FakeEvent) -> float:
        """Milliseconds from this event to `end`: one per op queued between them on their stream."""
        calls = self.calls
        if not (self.timing and end.timing) or self.clock is None or end.clock is None:
            calls.violations.append("timing: elapsed_time of an event without timing, or not recorded")
            return 0.0
        if self.stream != end.stream:
            calls.violations.append(f"timing: events of streams {self.stream} and {end.stream}")
        elif calls.host.get(self.stream, 0) < max(self.position, end.position):
            calls.violations.append(f"timing: elapsed_time read before stream {self.stream}'s events were done")
        return float(end.position - self.position)


@dataclass
class _Tracked:
    """A storage a side stream has touched: held, so its memory is not reused while tracked."""

    storage: torch.UntypedStorage
    host_buffer: bool  # one of the pool's page-locked buffers
    reads: Clock = field(default_factory=dict)  # stream -> its last read
    writes: Clock = field(default_factory=dict)  # stream -> its last write
    recorded: set[int] = field(default_factory=set)  # record_stream(tensor, stream)

    def accesses(self) -> list[tuple[int, int]]:
        return list(self.reads.items()) + list(self.writes.items())


class _CheckedPool(HostBufferPool):
    """The real pool, checking that a buffer handed back has no copy from or to it in flight."""

    def __init__(self, calls: RecordingCalls):
        super().__init__(calls.host_register, calls.host_unregister)
        self.calls = calls

    def give(self, buffer: HostBuffer) -> None:
        self.calls.check_host_knows(buffer.pages, "handed back to the pool")
        super().give(buffer)


class RecordingCalls(CudaCalls):
    """CudaCalls for CPU tensors: every device overlaps its copies; streams and events are fakes;
    registration is recorded (or fails with `fail_register`, a cudaError)."""

    def __init__(self, drop: str | None = None, fail_register: int = 0, drop_at: int | None = None):
        assert drop is None or drop in DROPPABLE, drop
        self.drop, self.fail_register, self.drop_at = drop, fail_register, drop_at
        self.calls: dict[str, int] = dict.fromkeys(DROPPABLE, 0)  # calls of each kind so far
        self.host: Clock = {}  # what the host knows done
        self.default = FakeStream(self, 0)
        self.streams = [self.default]
        self.current = self.default
        self.num_streams = 1
        self.registered: dict[int, int] = {}  # address -> bytes, registered now
        self.registrations: list[tuple[int, int]] = []  # every registration, in order
        self.side_ops = 0  # ops queued on side streams (copies): the checks had something to check
        self.synchronizes = 0  # device-wide synchronizes
        self.host_waits: list[str] = []  # "device", "stream", "event": every wait of the host
        self.timing_events: list[FakeEvent] = []  # recorded timing events, in order
        self.violations: list[str] = []
        self._tracked: dict[int, _Tracked] = {}  # storage address -> tracked
        self.pool = _CheckedPool(self)  # in place of CudaCalls.__init__'s unchecked one

    def dropped(self, kind: str) -> bool:
        """Whether this call of `kind` is swallowed (counting it)."""
        index = self.calls[kind]
        self.calls[kind] += 1
        return self.drop == kind and (self.drop_at is None or self.drop_at == index)

    # -- the calls ---------------------------------------------------------------------------------

    def overlaps(self, device: torch.device) -> bool:
        return True

    def runs_async(self, device: torch.device) -> bool:
        return True

    def synchronize(self, device: torch.device) -> None:
        """The host waits for every stream."""
        self.synchronizes += 1
        self.host_waits.append("device")
        if not self.dropped("device_synchronize"):
            for stream in self.streams:
                _merge(self.host, stream.clock)

    def new_stream(self, device: torch.device) -> FakeStream:
        self.num_streams += 1
        stream = FakeStream(self, self.num_streams - 1)
        self.streams.append(stream)
        return stream

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.current

    @contextmanager
    def use_stream(self, stream: FakeStream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def new_event(self, timing: bool = False) -> FakeEvent:
        return FakeEvent(self, timing)

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        if not self.dropped("record_stream"):
            self._track(tensor.untyped_storage()).recorded.add(stream.ident)

    def cuda_host_register(self, address: int, nbytes: int) -> int:
        if self.fail_register:
            return self.fail_register
        if address % PAGE_BYTES or nbytes % PAGE_BYTES:
            self.violations.append(f"register: [{address:#x}, +{nbytes}) is not whole pages")
        for other, size in self.registered.items():
            if other < address + nbytes and address < other + size:
                self.violations.append(f"register: [{address:#x}, +{nbytes}) overlaps [{other:#x}, +{size})")
        self.registered[address] = nbytes
        self.registrations.append((address, nbytes))
        return 0

    def cuda_host_unregister(self, address: int) -> int:
        if address not in self.registered:
            self.violations.append(f"register: unregister of {address:#x}, not registered")
            return 0
        for tracked in self._tracked.values():
            start = tracked.storage.data_ptr()
            if start <= address < start + tracked.storage.nbytes():
                self._check_host_knows(tracked, "unregistered")
        del self.registered[address]
        return 0

    def clear_pending_error(self) -> None:
        pass

    # -- the checks --------------------------------------------------------------------------------

    @contextmanager
    def tracking(self):
        """Queue every aten op on the current stream and check it (module docstring)."""
        try:
            with _StreamOps(self):
                yield
        finally:  # after an error too
            self.collect_frees()

    def check_host_knows(self, tensor: torch.Tensor, what: str) -> None:
        tracked = self._tracked.get(tensor.untyped_storage().data_ptr())
        if tracked is not None:
            self._check_host_knows(tracked, what)

    def _check_host_knows(self, tracked: _Tracked, what: str) -> None:
        for stream, position in tracked.accesses():
            if self.host.get(stream, 0) < position:
                self.violations.append(
                    f"host: a host buffer {what} while stream {stream}'s copy (op {position}) may be in flight"
                )

    def _track(self, storage: torch.UntypedStorage) -> _Tracked:
        key = storage.data_ptr()
        tracked = self._tracked.get(key)
        if tracked is None:
            end = key + storage.nbytes()
            host_buffer = any(key <= address < end for address in self.registered)
            tracked = self._tracked[key] = _Tracked(storage, host_buffer)
            if not host_buffer:  # the default stream may have written it up to now (module docstring)
                tracked.writes[self.default.ident] = self.default.clock[self.default.ident]
        return tracked

    def access(self, tensor: torch.Tensor, stream: FakeStream, position: int, write: bool, op) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() == 0:
            return
        tracked = self._tracked.get(storage.data_ptr())
        if tracked is None:
            if stream is self.default:
                return  # the default stream's own: ordered by the stream
            tracked = self._track(storage)
        others = list(tracked.writes.items()) + (list(tracked.reads.items()) if write else [])
        for other, at in others:
            if other != stream.ident and stream.clock.get(other, 0) < at:
                kind = "host buffer" if tracked.host_buffer else "device tensor"
                self.violations.append(
                    f"race: {op} on stream {stream.ident} {'writes' if write else 'reads'} a {kind} "
                    f"that stream {other} accessed at op {at}, without waiting for it"
                )
        (tracked.writes if write else tracked.reads)[stream.ident] = position

    def collect_frees(self) -> None:
        """Storages whose last reference is ours are freed by the program: check, and let them go."""
        for key, tracked in list(self._tracked.items()):
            if torch._C._storage_Use_Count(tracked.storage._cdata) > 1:
                continue
            del self._tracked[key]
            if tracked.host_buffer:
                continue  # checked when unregistered
            known = dict(self.default.clock)
            _merge(known, self.host)
            for stream, position in tracked.accesses():
                if stream != self.default.ident and known.get(stream, 0) < position and stream not in tracked.recorded:
                    self.violations.append(
                        f"free: a device tensor freed while stream {stream}'s copy (op {position}) may use it, "
                        f"without record_stream"
                    )

    def assert_clean(self) -> None:
        assert not self.violations, "\n".join(self.violations[:8])


def route_stores(monkeypatch, calls: RecordingCalls) -> None:
    """Every stream_backward step in the test makes its store's CUDA calls to `calls`."""
    monkeypatch.setattr(stream_module, "CheckpointStore", partial(CheckpointStore, calls=calls))
    monkeypatch.setattr(stream_module, "StreamingStore", partial(StreamingStore, calls=calls))


def _data_arguments(op, args, kwargs):
    """(tensor, written) for each tensor argument whose data the op reads or writes: its schema's
    `Tensor(a!)` arguments are written, arguments without alias read, and views (`Tensor(a)`) skipped."""
    for index, argument in enumerate(op._schema.arguments):
        if index < len(args):
            value = args[index]
        elif argument.name in kwargs:
            value = kwargs[argument.name]
        else:
            continue
        alias = argument.alias_info
        if alias is not None and not alias.is_write:
            continue
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, torch.Tensor):
                yield item, alias is not None


class _StreamOps(TorchDispatchMode):
    def __init__(self, calls: RecordingCalls):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        calls = self.calls
        calls.collect_frees()
        stream = calls.current
        position = stream.queue()
        if stream is not calls.default:
            calls.side_ops += 1
        for tensor, written in _data_arguments(func, args, kwargs):
            calls.access(tensor, stream, position, written, func)
        return func(*args, **kwargs)


class FakeCudaMemory:
    """torch.cuda's allocator calls: `reserved` bytes cached, `allocated` of them live; empty_cache
    hands the rest back (and is counted). Not initialised: nothing cached, as torch.cuda says."""

    def __init__(self, *, initialized: bool = True, reserved: int = 0, allocated: int = 0):
        self.initialized, self.reserved, self.allocated = initialized, reserved, allocated
        self.empty_cache_calls = 0

    def is_initialized(self) -> bool:
        return self.initialized

    def memory_reserved(self, device=None) -> int:
        return self.reserved

    def memory_allocated(self, device=None) -> int:
        return self.allocated

    def empty_cache(self) -> None:
        assert self.initialized, "empty_cache would initialise CUDA"
        self.empty_cache_calls += 1
        self.reserved = self.allocated


class FakeNvml:
    """pynvml's memory and process queries for one device: `used` of `total` bytes, and the
    compute processes as (pid, bytes or None: NVML cannot always say)."""

    def __init__(self, *, total: int, used: int, processes=()):
        self.total, self.used, self.processes = total, used, list(processes)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(total=self.total, used=self.used, free=self.total - self.used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.processes]


class RecordingMemoryHistory:
    """torch.cuda.memory's history calls (measure/timeline/cuda.py CudaMemoryCalls) for CPU tensors.

    While started, a dispatch mode sees each storage an op makes (not one of its inputs', not
    empty, as the tracker and the caching allocator count them) and writes the allocator's trace
    entries for it: "alloc" with its data_ptr, its size and the metadata set then, and, when it
    dies, "free_requested" then "free_completed". Entries carry a time_us that counts up. The
    trace keeps at most `max_entries` (a ring buffer, as the allocator's). `calls` records every
    call in order; `allocated()` is the baseline plus what is live, `peak` the most it was."""

    def __init__(self, baseline_bytes: int = 0):
        self.baseline_bytes, self.live_bytes, self.peak = baseline_bytes, 0, baseline_bytes
        self.calls: list = []
        self.metadata = ""
        self.entries: list[dict] = []
        self.max_entries = 0
        self._time = 0
        self._mode = None

    def start(self, max_entries: int) -> None:
        self.calls.append(("start", max_entries))
        self.max_entries, self.entries = max_entries, [{"action": "alloc", "addr": 1, "size": 8, "time_us": 0}]
        self._mode = _HistoryMode(self)
        self._mode.__enter__()

    def stop(self) -> None:
        self.calls.append(("stop",))
        self._mode.__exit__(None, None, None)

    def set_metadata(self, text: str) -> None:
        self.calls.append(("set_metadata", text))
        self.metadata = text

    def snapshot(self) -> dict:
        self.calls.append(("snapshot",))
        self._entry("snapshot", 0, 0)
        self.at_snapshot = self.allocated()
        return {"segments": [], "device_traces": [self.entries[-self.max_entries :]], "allocator_settings": {}}

    def allocated(self, device=None) -> int:
        return self.baseline_bytes + self.live_bytes

    def _entry(self, action: str, address: int, nbytes: int) -> None:
        self._time += 3
        entry = {"action": action, "addr": address, "size": nbytes, "stream": 0, "time_us": self._time}
        self.entries.append({**entry, "user_metadata": self.metadata, "compile_context": "N/A"})

    def allocate(self, storage) -> None:
        address, nbytes = storage.data_ptr(), storage.nbytes()
        self._entry("alloc", address, nbytes)
        self.live_bytes += -(-nbytes // 512) * 512
        self.peak = max(self.peak, self.allocated())

    def free(self, address: int, nbytes: int) -> None:
        self._entry("free_requested", address, nbytes)
        self._entry("free_completed", address, nbytes)
        self.live_bytes -= -(-nbytes // 512) * 512


class _HistoryMode(TorchDispatchMode):
    def __init__(self, history: RecordingMemoryHistory):
        super().__init__()
        self.history = history
        self.seen: dict[int, object] = {}  # storage id -> weakref

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        from torch.utils._pytree import tree_leaves

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in (t for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in inputs or key in self.seen or storage.nbytes() == 0 or tensor.is_meta:
                continue
            self.history.allocate(storage)
            address, nbytes = storage.data_ptr(), storage.nbytes()
            self.seen[key] = weakref.ref(storage, lambda _, k=key, a=address, n=nbytes: self._died(k, a, n))
        return out

    def _died(self, key: int, address: int, nbytes: int) -> None:
        if self.seen.pop(key, None) is not None:
            self.history.free(address, nbytes)
