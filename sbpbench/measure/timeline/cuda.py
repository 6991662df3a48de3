"""A step's memory timeline on a GPU: PyTorch's memory history, marked with the step's phases.

`torch.cuda.memory._record_memory_history` makes the caching allocator keep a trace entry per
allocation and free (torch 2.11-2.13: a dict with action "alloc" | "free_requested" |
"free_completed" | "segment_*" | "snapshot" | "oom", addr, size, stream, time_us and the
`user_metadata` string set by `_set_memory_metadata`). `_snapshot()` returns them with the segments
(the dict pytorch.org/memory_viz reads; the recorder pickles it beside the row).

The metadata is per thread: c10/cuda/CUDACachingAllocator.cpp keeps it in a `static thread_local`
member, and an entry carries the metadata of the thread that allocated or freed. On a GPU, autograd
runs a backward on its device thread, whose metadata the step's thread never sets. So the recorder
runs the step's backward on the step's thread (`torch.autograd.set_multithreading_enabled(False)`
while it records: for a graph on one GPU the engine runs the same nodes in the same order, so what
is allocated is the same), and its replay does not rely on that either (below).

Marks. Each time the phase or the kind of what is allocated changes, the recorder sets the
metadata to "sbp <seq> <kind> <phase>" (tab-separated) with a new sequence number, so every entry
says where the step was and what the allocation is for. A tensor that turns out to be of a kind
after it was made (the embedding's output, which the checkpoint store keeps) is a note: its storage
address with the sequence number then, applied in the replay before the first entry made after it.

Replay (`timeline_from_trace`). Every alloc and free_requested entry from the recorder's first mark
on is the step's: a worker's other thread (the NVML sampler) allocates nothing on the GPU, and the
step's side streams (host copies) are its own. An entry counts under the latest mark in the trace
up to it: its own, unless it has none (another thread's, or another tool's metadata) or one older
than a mark already seen (a thread whose metadata was set earlier); the main thread waits inside a
backward, so the latest mark is where the step is. Allocated bytes start at the baseline
(torch.cuda.memory_allocated before the step) and move by each alloc and free_requested entry (the
moment allocated bytes drop in the allocator), each size rounded up to 512 B as the allocator
rounds a request and as the estimator counts: max_memory_allocated counts whole blocks, a little
more where a block was not split, so the row keeps it beside the timeline's peak
(`allocator_peak_bytes`). If the ring buffer of entries was full (more than `max_entries` events),
the replay starts at the oldest kept entry, anchored at the allocated bytes after the step, and
the timeline says it starts late.
"""

from __future__ import annotations

import bisect
import pickle
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import torch

from .data import INTERMEDIATES, OTHER, Timeline, breakdown
from .log import TimelineLog
from .marks import PhaseMarks

ROUNDING = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize: a request is rounded up to a multiple
# Trace entries kept at most: a long StreamBP step makes about 100 per layer and chunk (Qwen3-8B at
# T = 64k: 36 layers x 131 chunks, about 0.5M). An entry with its Python stack takes a KB or more of
# host memory and of the pickled snapshot, so a longer step keeps its last million.
MAX_ENTRIES = 1_000_000
PREFIX = "sbp"


class CudaMemoryCalls:
    """The torch.cuda.memory calls the recorder makes, in one object (tests pass a stand-in)."""

    def start(self, max_entries: int) -> None:
        # context "alloc": each allocation's Python stack (what memory_viz shows), none for frees
        torch.cuda.memory._record_memory_history(
            enabled="all", context="alloc", stacks="python", max_entries=max_entries, clear_history=True
        )

    def stop(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)

    def set_metadata(self, text: str) -> None:
        torch.cuda.memory._set_memory_metadata(text)

    def snapshot(self) -> dict:
        return torch.cuda.memory._snapshot()

    def allocated(self, device: torch.device) -> int:
        return torch.cuda.memory_allocated(device)


CUDA_MEMORY = CudaMemoryCalls()


@dataclass(frozen=True)
class Note:
    seq: int
    addresses: tuple[int, ...]
    kind: str


class CudaTimeline(PhaseMarks):
    """with CudaTimeline(device, resident_kinds) as recorder: step(); recorder.timeline(baseline_bytes, ...).

    resident_kinds: what of the memory allocated before the step is weights, gradients, optimizer
    state and batch (storage bytes, rounded to 512 B). Also the listener of core/memory_kinds.py
    (begin, end, note) and of the step's phase marks."""

    def __init__(
        self,
        device: torch.device,
        resident_kinds: dict[str, int],
        *,
        calls: CudaMemoryCalls = CUDA_MEMORY,
        max_entries: int = MAX_ENTRIES,
    ):
        self.device, self.calls, self.max_entries = device, calls, max_entries
        self.resident_kinds = dict(resident_kinds)
        self._start_marks()
        self.seq = 0
        self._name, self._phase_kind, self._explicit = self.steps.name, INTERMEDIATES, None
        self.notes: list[Note] = []
        self.host: dict[str, list] = {"at": [], "pinned_bytes": [], "rss_bytes": []}  # at: a sequence number
        self.snapshot: dict | None = None
        self.allocated_after: int | None = None
        self.failure: Exception | None = None  # why there is no snapshot
        self._restore = ExitStack()  # multithreaded backward as it was

    def __enter__(self) -> Self:
        with ExitStack() as stack:
            # the backward on this thread, whose metadata is the marks (module docstring)
            stack.enter_context(torch.autograd.set_multithreading_enabled(False))
            self.calls.start(self.max_entries)
            self._write()
            self._restore = stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        try:  # after an OOM too: the history up to it is what a user needs
            self.calls.set_metadata("")
            self.allocated_after = self.calls.allocated(self.device)
            self.snapshot = self.calls.snapshot()
        except Exception as error:
            self.failure = error
        finally:
            try:
                self.calls.stop()
            finally:
                self._restore.close()

    def _write(self) -> None:
        self.seq += 1
        kind = self._explicit or self._phase_kind
        self.calls.set_metadata(f"{PREFIX}\t{self.seq}\t{kind}\t{self._name}")

    # -- marks ------------------------------------------------------------------------------------

    def _now(self) -> int:
        return self.seq

    def _mark(self, name: str, kind: str) -> None:
        if (name, kind) != (self._name, self._phase_kind):
            self._name, self._phase_kind = name, kind
            self._write()

    def _host_sample(self, at: int, pinned: int | None, rss: int | None) -> None:
        for key, value in zip(self.host, (at, pinned, rss)):
            self.host[key].append(value)

    # -- core/memory_kinds.py's listener ------------------------------------------------------------

    def begin(self, kind: str) -> str | None:
        previous, self._explicit = self._explicit, kind
        self._write()
        return previous

    def end(self, previous: str | None) -> None:
        self._explicit = previous
        self._write()

    def note(self, kind: str, tensors) -> None:
        self._write()  # entries from here on are after the note
        addresses = tuple(getattr(t, "_local_tensor", t).untyped_storage().data_ptr() for t in tensors)
        self.notes.append(Note(self.seq, addresses, kind))

    # -- the result -------------------------------------------------------------------------------

    def save_snapshot(self, path: str | Path) -> Path:
        """The raw snapshot, pickled as torch.cuda.memory._dump_snapshot writes it (pytorch.org/memory_viz)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            pickle.dump(self.snapshot, f)
        return path

    def timeline(self, baseline_bytes: int, **fields) -> Timeline:
        """baseline_bytes: torch.cuda.memory_allocated before the step."""
        if self.snapshot is None:
            raise RuntimeError(f"no memory snapshot of the step: {self.failure!r}")
        index = self.device.index or 0
        traces = self.snapshot.get("device_traces") or []
        trace = traces[index] if index < len(traces) else []
        return timeline_from_trace(
            trace, baseline_bytes, self.resident_kinds, self.notes, self.host,
            truncated=len(trace) >= self.max_entries, allocated_after=self.allocated_after, **fields,
        )  # fmt: skip


def _rounded(nbytes: int) -> int:
    return max(ROUNDING, -(-nbytes // ROUNDING) * ROUNDING)


def _ours(entry: dict) -> tuple[int, str, str] | None:
    """(seq, kind, phase) of the mark an entry carries; None for none (another thread's, another tool's)."""
    parts = str(entry.get("user_metadata") or "").split("\t")
    if len(parts) != 4 or parts[0] != PREFIX:
        return None
    return int(parts[1]), parts[2], parts[3]


def _marked_entries(trace: list[dict], truncated: bool) -> list[tuple[dict, tuple[int, str, str]]]:
    """The step's alloc and free_requested entries, each with the latest mark up to it (module docstring)."""
    marks = [_ours(entry) for entry in trace]
    # a full history starts inside the step; otherwise the step starts at the recorder's first mark
    first = 0 if truncated else next((i for i, mark in enumerate(marks) if mark is not None), len(trace))
    latest = next((mark for mark in marks[first:] if mark is not None), (0, INTERMEDIATES, ""))
    entries = []
    for entry, mark in zip(trace[first:], marks[first:]):
        if mark is not None and mark[0] > latest[0]:
            latest = mark
        if entry.get("action") in ("alloc", "free_requested"):
            entries.append((entry, latest))
    return entries


def timeline_from_trace(
    trace: list[dict],
    baseline_bytes: int,
    resident_kinds: dict[str, int],
    notes: list[Note],
    host: dict[str, list],
    *,
    truncated: bool = False,
    allocated_after: int | None = None,
    **fields,
) -> Timeline:
    """Replay the allocator's entries of one step into a Timeline (module docstring). The resident
    kinds are the baseline's known part; the rest of the baseline counts as other."""
    entries = _marked_entries(trace, truncated)
    kinds = dict(resident_kinds)
    kinds[OTHER] = kinds.get(OTHER, 0) + max(0, baseline_bytes - sum(resident_kinds.values()))
    allocated = sum(kinds.values())
    if truncated and allocated_after is not None:  # the first entries are gone: anchor at the end
        change = sum(_rounded(e["size"]) * (1 if e["action"] == "alloc" else -1) for e, _ in entries)
        kinds[OTHER] += allocated_after - change - allocated
        allocated = allocated_after - change
    start = entries[0][0].get("time_us", 0) if entries else 0
    log = TimelineLog()
    live: dict[int, tuple[int, str]] = {}  # address -> (rounded size, kind)
    pending = sorted(notes, key=lambda n: n.seq)
    peak_kinds, peak = dict(kinds), allocated
    log.phase = entries[0][1][2] if entries else ""
    log.add(0, allocated)
    seq_times: list[tuple[int, int]] = []  # (seq, at) of the first entry of each sequence number
    for entry, (seq, kind, phase) in entries:
        while pending and pending[0].seq <= seq:
            _apply(pending.pop(0), live, kinds)
        at = int(entry.get("time_us", 0)) - start
        if not seq_times or seq_times[-1][0] != seq:
            seq_times.append((seq, at))
        size, address = _rounded(int(entry["size"])), int(entry["addr"])
        if entry["action"] == "alloc":
            live[address] = (size, kind)
            allocated += size
            kinds[kind] = kinds.get(kind, 0) + size
        else:
            size, kind = live.pop(address, (size, OTHER))  # made before the step: the baseline's
            allocated -= size
            kinds[kind] = kinds.get(kind, 0) - size
        log.phase = phase
        log.add(at, allocated)
        if allocated > peak:
            peak, peak_kinds = allocated, dict(kinds)
    seqs = [seq for seq, _ in seq_times]
    for at_seq, pinned, rss in zip(host["at"], host["pinned_bytes"], host["rss_bytes"]):
        later = bisect.bisect_left(seqs, at_seq)  # the first entry made at or after the sample
        log.host_sample(seq_times[later][1] if later < len(seq_times) else log.last_at, pinned, rss)
    timeline = log.timeline(
        kinds=breakdown(peak_kinds), source="measured", memory_source="torch.cuda", axis="us",
        baseline_bytes=baseline_bytes, **fields,
    )  # fmt: skip
    if truncated:
        timeline.notes.append("the memory history was full: the timeline starts with its oldest kept event")
    return timeline


def _apply(note: Note, live: dict[int, tuple[int, str]], kinds: dict[str, int]) -> None:
    for address in note.addresses:
        if address in live:
            size, old = live[address]
            live[address] = (size, note.kind)
            kinds[old] -= size
            kinds[note.kind] = kinds.get(note.kind, 0) + size
