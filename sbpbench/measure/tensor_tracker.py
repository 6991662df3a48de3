"""Live tensor bytes on any device: the CPU analogue of torch.cuda.memory_allocated().

A TorchDispatchMode sees every aten op, forward and backward, including factory functions. Each
storage an op creates (an output storage that none of its inputs owned) is counted when it is
created and uncounted by a weakref finalizer when its last tensor dies, the way torch's own
`torch.distributed._tools.mem_tracker` does. Tensors that existed before the mode (weights,
resident gradients) are not counted, so `peak_bytes` is the activation peak above them.
Deterministic for a given program, which is why tests may assert ratios of it.

With `limit_bytes`, an op that takes the live bytes over the limit raises TrackedOutOfMemoryError
right after it runs: the CPU stand-in for a CUDA out-of-memory error on a smaller device.

Each storage is counted under a kind (`kind_bytes`; `peak_kinds` at the peak): `kind_of_new` when
it is made, or the kind a `note` gives it later (measure/timeline/data.py names the kinds; a
memory timeline sets them from the step's phase and StreamBP's own seam, core/memory_kinds.py, whose
listener the tracker is: `begin`, `end`, `note`). Left alone, everything is "intermediates".

A collective (a `c10d` op: gloo's all-to-all, all-gather, reduce-scatter) runs on copies of its
tensors made below the mode, is waited on at once, and its results are copied back. The process
group's worker thread keeps a finished collective's tensors until it gets round to dropping them,
after the caller has moved on; a storage whose last holder is that thread would be uncounted at a
time set by thread scheduling, and a rank's peak would differ from run to run by a buffer or two.
On copies, every counted storage is freed in program order, as the estimator frees it. The
memory step is not the timed one, so the copies and waits cost no measured time.

A storage resized in place (`untyped_storage().resize_()`, which FSDP2 uses to free and re-allocate
an unsharded parameter between uses) bypasses the dispatcher; `resized(storage)` counts its new size,
and `counting_fsdp_resizes(tracker)` reports FSDP2's resizes to the tracker while it is active.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from .timeline.data import INTERMEDIATES


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments or results, in order. Aten values are flat (tensors,
    scalars, lists of those), so two levels are read directly: tree_leaves costs more per op, and
    is used only when something is nested deeper."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    found.append(item)
                elif isinstance(item, (list, tuple, dict)):
                    return [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]
        elif isinstance(value, dict):
            return [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]
    return found


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds the bytes: a DTensor's (FSDP2's sharded parameters and
    gradients) local shard; any other tensor itself."""
    return getattr(t, "_local_tensor", t)


def _collective_on_copies(func, args, kwargs):
    """Run the c10d op `func` on copies of its tensors (below the mode, so never counted), wait for
    it, write every copy back into its tensor, and return what the op returned with the copies
    replaced by the caller's tensors (its Work already finished: the caller's wait returns at once)."""
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(copy) -> (caller's tensor, copy)

    def private(tensor: torch.Tensor) -> torch.Tensor:
        copy = tensor.clone()
        copies[id(copy)] = (tensor, copy)
        return copy

    out = func(*tree_map_only(torch.Tensor, private, args), **tree_map_only(torch.Tensor, private, kwargs))
    for work in tree_leaves(out):
        if isinstance(work, torch.ScriptObject) and hasattr(work, "wait"):
            work.wait()
    for tensor, copy in copies.values():  # inputs come back unchanged; outputs with the result
        tensor.copy_(copy)
    return tree_map_only(torch.Tensor, lambda t: copies.get(id(t), (t,))[0], out)


class TrackedOutOfMemoryError(RuntimeError):
    """The tracked live bytes went over the tracker's limit (the CPU analogue of a CUDA OOM)."""


@dataclass(frozen=True)
class Allocation:
    numel: int
    nbytes: int
    op: str


class LiveTensorTracker(TorchDispatchMode):
    """with LiveTensorTracker() as tracker: step(); tracker.peak_bytes, tracker.largest."""

    def __init__(self, granularity_bytes: int = 1, limit_bytes: int | None = None):
        super().__init__()
        if granularity_bytes < 1:
            raise ValueError("granularity_bytes must be >= 1")
        self.limit_bytes = limit_bytes
        self.granularity_bytes = granularity_bytes  # e.g. 512 to round as the CUDA caching allocator does
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest = Allocation(0, 0, "")
        self._refs: dict[int, weakref.ref] = {}
        self._counted: dict[int, int] = {}  # storage id -> bytes counted for it now
        self._kinds: dict[int, str] = {}  # storage id -> its kind
        self.kind_bytes: dict[str, int] = defaultdict(int)  # live bytes per kind
        self.peak_kinds: dict[str, int] = {}  # kind_bytes when the peak was set
        self.kind_of_new = INTERMEDIATES  # the kind a storage made now is counted under
        self._phase_kind = INTERMEDIATES  # kind_of_new outside any `begin` block
        self._explicit: str | None = None  # the kind of the innermost `begin` block

    # -- kinds: core/memory_kinds.py's listener, and the phase's default -------------------------

    def begin(self, kind: str) -> str | None:
        previous, self._explicit = self._explicit, kind
        self.kind_of_new = kind
        return previous

    def end(self, previous: str | None) -> None:
        self._explicit = previous
        self.kind_of_new = previous or self._phase_kind

    def set_phase_kind(self, kind: str) -> None:
        """What storages made outside a `begin` block are (a step's head: logits; else intermediates)."""
        self._phase_kind = kind
        self.kind_of_new = self._explicit or kind

    def note(self, kind: str, tensors) -> None:
        """Count these tensors' storages under `kind` from now on (storages made before the tracker: no change)."""
        for tensor in tensors:
            key = id(_plain(tensor).untyped_storage())
            old = self._kinds.get(key)
            if old is not None and old != kind:
                nbytes = self._counted[key]
                self.kind_bytes[old] -= nbytes
                self.kind_bytes[kind] += nbytes
                self._kinds[key] = kind

    def _rounded(self, nbytes: int) -> int:
        g = self.granularity_bytes
        return -(-nbytes // g) * g

    def _forget(self, key: int, _ref=None) -> None:
        if self._refs.pop(key, None) is not None:
            nbytes = self._counted.pop(key)
            self.live_bytes -= nbytes
            self.kind_bytes[self._kinds.pop(key)] -= nbytes

    def _count(self, storage, key: int, nbytes: int) -> None:
        rounded = self._rounded(nbytes)
        if key not in self._refs:
            self._refs[key] = weakref.ref(storage, lambda ref, k=key: self._forget(k, ref))
            self._counted[key] = 0
            self._kinds[key] = self.kind_of_new
        change = rounded - self._counted[key]
        self.live_bytes += change
        self.kind_bytes[self._kinds[key]] += change
        self._counted[key] = rounded
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_kinds = dict(self.kind_bytes)

    def _track(self, tensor: torch.Tensor, op) -> None:
        """Count tensor's storage if new; op: the aten op that made it (named only when it is the
        largest so far: str() of an op costs microseconds, paid on every op otherwise)."""
        storage = tensor.untyped_storage()
        key = id(storage)
        nbytes = storage.nbytes()
        if key in self._refs or nbytes == 0:
            return
        self._count(storage, key, nbytes)
        numel = nbytes // tensor.element_size()
        if numel > self.largest.numel:
            self.largest = Allocation(numel, nbytes, str(op))

    def resized(self, storage) -> None:
        """A storage changed size in place: count it at its new size (from now on, if it was not
        counted before: a storage made before the tracker and freed in it is not subtracted)."""
        key = id(storage)
        if key in self._refs or storage.nbytes() > 0:
            self._count(storage, key, storage.nbytes())
        self._check_limit("storage resize_")

    def _check_limit(self, op) -> None:
        """op: the aten op (or a description) just run, named in the error."""
        if self.limit_bytes is not None and self.live_bytes > self.limit_bytes:
            raise TrackedOutOfMemoryError(
                f"tracked live tensors reached {self.live_bytes:,} B, over the limit of {self.limit_bytes:,} B ({op})"
            )

    def _is_meta(self, t: torch.Tensor) -> bool:
        """Whether t lives on the meta device (no memory). A subclass may answer more cheaply."""
        return t.is_meta

    def _run(self, func, args, kwargs):
        """Run one op. A subclass may run it elsewhere (the simulator runs ops on real tensors
        outside its fake-tensor mode); what it returns is counted the same way."""
        if func.namespace == "c10d":
            return _collective_on_copies(func, args, kwargs)
        return func(*args, **kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self._run(func, args, kwargs)
        is_meta = self._is_meta
        inputs = {id(_plain(t).untyped_storage()) for t in _tensors((*args, *kwargs.values())) if not is_meta(t)}
        for t in _tensors((out,)):
            if not is_meta(t) and id(_plain(t).untyped_storage()) not in inputs:
                self._track(_plain(t), func)
        self._check_limit(func)
        return out


@contextmanager
def counting_fsdp_resizes(tracker: LiveTensorTracker):
    """Report FSDP2's in-place storage resizes (its `alloc_storage` / `free_storage`, torch 2.4-2.13,
    looked up as module globals by FSDP2's parameter and parameter-group modules) to `tracker`."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    modules = [m for m in (_fsdp_param, _fsdp_param_group) if hasattr(m, "alloc_storage")]
    saved = {
        (m, name): getattr(m, name) for m in modules for name in ("alloc_storage", "free_storage") if hasattr(m, name)
    }

    def reporting(original):
        def resize(tensor: torch.Tensor) -> None:
            original(tensor)
            tracker.resized(tensor.untyped_storage())

        return resize

    for (module, name), original in saved.items():
        setattr(module, name, reporting(original))
    try:
        yield tracker
    finally:
        for (module, name), original in saved.items():
            setattr(module, name, original)
