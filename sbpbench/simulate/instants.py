"""Where in a step each op runs, and the memory then: the record T-extrapolation (length.py) fits.

`InstantRecorder` is the simulator's counter (memory_counter.py) that also keeps, for every op:
- its instant key (label, chunk, episode, ordinal): the phase label (methods/phase_labels.py); the StreamBP
  chunk the op belongs to, read from the state a decoder layer is called with (core/attention.py:
  its kind, capture / attend / grad, and its start, named "first" for the chunk at 0 and by its
  distance from the end of the sequence otherwise; a sequence-parallel step's from its layers'
  input_layernorm and its phases, sequence_parallel.py `SequenceChunks`); the episode (how many
  times this (label, chunk) pair began before) and the op's ordinal within it. The same key
  names the same op at every length whose chunks end alike (lengths of one remainder by the chunk
  sizes): the first chunk, and the last ones counted from the end. Chunks in between get keys
  of their own at each length and are not compared;
- the live bytes during the op (its in-kernel buffers included), as the counter counts them;
- every block (storage, or in-kernel buffer) with its size before rounding, the key of the op
  that made it (its site) and the ops it lived through, so the allocator's rounding can be
  redone for the sizes another length gives.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from ..core import UnsupportedModelError
from ..core.internal import STATE_KWARG, ChunkState, KVBuffer, forwards_wrapped, resolve_parts
from ..methods.streambp import step_hooks
from .memory_counter import SimulatedMemory
from .sequence_parallel import SequenceChunks

FIRST = "first"


@dataclass
class Block:
    site: tuple  # (key of the op that made it, its index among that op's new blocks)
    nbytes: int  # before rounding
    born: int  # the first op it is live in
    died: int | None = None  # the first op it is no longer live in (None: live to the end)


def chunk_of(state) -> tuple[str, int | str] | None:
    """(kind, position) of the StreamBP chunk an attention call runs: position "first" for the
    chunk at 0, else the distance from its start to the end of the sequence."""
    if isinstance(state, KVBuffer):
        kind, seq_len = ("attend" if state.attend else "capture"), state.seq_len
    elif isinstance(state, ChunkState):
        kind, seq_len = "grad", state.buffer.seq_len
    else:
        return None
    return kind, FIRST if state.start == 0 else seq_len - state.start


class InstantRecorder(SimulatedMemory):
    """with fake_mode, InstantRecorder(...) as record: step(); record.keys, .values, .blocks."""

    def __init__(self, granularity_bytes: int = 1, hidden=None):
        self._label: str | None = None
        self._chunk: tuple | None = None
        self._episodes: dict[tuple, int] = {}
        self._episode = self._ordinal = self._op = 0
        self._made = 0  # new blocks of the op running now
        self.keys: list[tuple] = []  # per op
        self.ops: list = []  # per op: the aten op
        self.values: list[int] = []  # per op: live bytes (rounded) during it
        self.blocks: list[Block] = []
        self._live: dict[int, int] = {}  # storage id -> its index in blocks
        # a sequence-parallel step's local chunks (sequence_parallel.py), whose layers are not wrapped
        self.sequence_bounds: list[tuple[int, int]] | None = None
        super().__init__(granularity_bytes, hidden)

    @property
    def phase(self) -> str:
        return self._label

    @phase.setter
    def phase(self, label: str) -> None:
        if label != self._label:
            self._label = label
            self._begin()

    def _begin(self) -> None:
        pair = (self._label, self._chunk)
        self._episode = self._episodes[pair] = self._episodes.get(pair, -1) + 1
        self._ordinal = 0

    def _key(self) -> tuple:
        return (self._label, self._chunk, self._episode, self._ordinal)

    @contextmanager
    def attached(self, step):
        """Learn each StreamBP chunk as a decoder layer is called on it: each layer's forward is
        wrapped on the instance for the duration (the checkpoint pass, which calls the layers'
        forward chunk by chunk, wraps whatever is there and puts it back), and each chunk of a K/V
        capture from the step's `on_capture` hook."""
        if self.sequence_bounds is not None:  # a wrapped forward would cost the layers their K/V recipe
            chunks = SequenceChunks(self.sequence_bounds, self.set_chunk, lambda: self._label)
            with chunks.attached(step.model):
                yield self
            return
        try:
            layers = resolve_parts(step.model).layers
        except UnsupportedModelError:
            layers = []  # a family StreamBP does not run: no chunks to learn
        # a K/V capture by the layer's projection calls no layer: its chunks are told by the step
        told = step_hooks(on_capture=lambda buffer: self.set_chunk(chunk_of(buffer)))
        with forwards_wrapped(layers, lambda index, forward: self._watching(forward)), told:
            yield self

    def set_chunk(self, chunk: tuple) -> None:
        """The chunk the next ops belong to (a new episode where it changes)."""
        if chunk != self._chunk:
            self._chunk = chunk
            self._begin()

    def _watching(self, forward):
        def watched(*args, **kwargs):
            chunk = chunk_of(kwargs.get(STATE_KWARG))
            # a capture's layer call holds a chunk-long buffer of its own (start 0): `on_capture` names it
            if chunk is not None and chunk[0] != "capture":
                self.set_chunk(chunk)
            return forward(*args, **kwargs)

        return watched

    def _count(self, storage, key: int, nbytes: int) -> None:
        new = key not in self._refs
        super()._count(storage, key, nbytes)
        if new:
            self._live[key] = len(self.blocks)
            self.blocks.append(Block((self._key(), self._made), nbytes, self._op))
            self._made += 1

    def _forget(self, key: int, _ref=None) -> None:
        index = self._live.pop(key, None)
        if index is not None:
            self.blocks[index].died = self._op
        super()._forget(key, _ref)

    def observe(self, func, live_bytes: int, inside: list[int]) -> None:
        key = self._key()
        self.keys.append(key)
        self.ops.append(func)
        self.values.append(live_bytes)
        for index, nbytes in enumerate(inside):
            self.blocks.append(Block((key, "hidden", index), nbytes, self._op, self._op + 1))
        self._op += 1
        self._ordinal += 1
        self._made = 0
