"""(B, T, d) tensors that StreamBP reads and writes a chunk of positions at a time: a layer input
X_l, the last layer's output Z_L, the gradient dZ / dX.

Every phase reads them chunk by chunk (the checkpoint pass and the K/V capture first to last, the
chunks of the layer backward last to first, the head's chunks) and writes the gradient chunk by
chunk, so none needs to be on the device whole. Three kinds, one interface (`chunks`, `write`,
`zero`):
- `DeviceSequence`: a tensor on the device, read as views and written in place (every placement
  but stream: the operations as before);
- `HostSequence`: one host buffer (page-locked, of the process's pool, on CUDA); each chunk copied
  to the device on the side stream one chunk ahead of the loop reading it, each written chunk
  copied back as it is made (host_copies.py);
- `EmbeddedSequence`: X_0 as the embedding of the input ids, computed chunk by chunk when read:
  the same values as the embedding of the whole sequence, sliced (a gather, a scale), and no memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch

from ..memory_kinds import CHECKPOINTS, KindListener, allocating
from .host_copies import Copier

Bounds = Sequence[tuple[int, int]]  # (start, end) of each chunk, in the order a loop reads them


class DeviceSequence:
    """A (B, T, d) tensor on its device. zeroed: it holds zeros where nothing was written (the
    head's gradient), so `zero` has nothing to do."""

    def __init__(self, tensor: torch.Tensor, *, zeroed: bool = False):
        self.tensor = tensor
        self.zeroed = zeroed

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def chunks(self, bounds: Bounds) -> Iterator[torch.Tensor]:
        for start, end in bounds:
            yield self.tensor[:, start:end]

    def write(self, start: int, end: int, values: torch.Tensor) -> None:
        self.tensor[:, start:end] = values

    def zero(self, start: int, end: int) -> None:
        if not self.zeroed:
            self.tensor[:, start:end].zero_()


class HostSequence:
    """A (B, T, d) tensor in host memory, moved a chunk at a time through `copier`. shapes_only (the
    memory simulator): no host memory, each chunk read is an empty device tensor, writes move
    nothing; the byte counters count as if they did. kinds: told the host copy is checkpoints."""

    def __init__(
        self,
        copier: Copier,
        shape: torch.Size,
        dtype: torch.dtype,
        device: torch.device,
        *,
        shapes_only: bool,
        kinds: KindListener | None = None,
    ):
        self.copier, self.shape, self.dtype, self.device = copier, torch.Size(shape), dtype, device
        self.nbytes = math.prod(shape) * dtype.itemsize
        self._buffer = None  # the pool's page-locked buffer under `host` (CUDA)
        self._last = None  # the event after the latest copy from or to it
        if shapes_only:
            self.host = None
        elif copier.overlaps(device):
            self._buffer = copier.take_buffer(self.nbytes)
            self.host = self._buffer.view(self.shape, dtype)
        else:
            with allocating(kinds, CHECKPOINTS):  # a CPU device: ordinary memory, the memory counted
                self.host = torch.empty(self.shape, dtype=dtype)

    def chunks(self, bounds: Bounds) -> Iterator[torch.Tensor]:
        """Each chunk on the device in order. The first chunk's copy starts now; each later one's
        when the chunk before it is handed out, so it runs while the caller works on that one. The
        compute stream waits for a chunk's copy when the chunk is handed out, not before."""
        return _Reader(self, list(bounds))

    def _fetch(self, start: int, end: int) -> tuple[torch.Tensor, object]:
        if self.host is None:
            self.copier.to_device_bytes += self.nbytes // self.shape[1] * (end - start)
            return torch.empty(self._chunk_shape(start, end), dtype=self.dtype, device=self.device), None
        target, event = self.copier.to_device(self.host[:, start:end], self.device)
        self._last = event if event is not None else self._last
        return target, event

    def arrive(self, target: torch.Tensor, event) -> torch.Tensor:
        self.copier.arrive(event, self.device)
        return target

    def write(self, start: int, end: int, values: torch.Tensor) -> None:
        """host[:, start:end] <- values, copied as soon as the compute stream has made them."""
        if self.host is None:
            self.copier.to_host_bytes += values.nbytes
            return
        event = self.copier.to_host(self.host[:, start:end], values)
        self._last = event if event is not None else self._last

    def zero(self, start: int, end: int) -> None:
        """Zeros at [start, end), written as the other writes are (in order with the copies)."""
        self.write(start, end, torch.zeros(self._chunk_shape(start, end), dtype=self.dtype, device=self.device))

    def _chunk_shape(self, start: int, end: int) -> tuple[int, ...]:
        return (self.shape[0], end - start, *self.shape[2:])

    def release(self) -> None:
        """Hand the buffer back to the pool once no copy uses it."""
        if self._buffer is not None:
            self.copier.give_buffer(self._buffer, self._last)
            self._buffer = self.host = None


class _Reader:
    """HostSequence.chunks: an iterator with one copy ahead of the chunk handed out."""

    def __init__(self, sequence: HostSequence, bounds: list[tuple[int, int]]):
        self.sequence, self.bounds, self.next_index = sequence, bounds, 0
        self.ahead = sequence._fetch(*bounds[0]) if bounds else None

    def __iter__(self) -> _Reader:
        return self

    def __next__(self) -> torch.Tensor:
        if self.next_index >= len(self.bounds):
            raise StopIteration
        current = self.ahead
        self.next_index += 1
        following = self.next_index < len(self.bounds)
        self.ahead = self.sequence._fetch(*self.bounds[self.next_index]) if following else None
        return self.sequence.arrive(*current)


class EmbeddedSequence:
    """X_0 (B, T, d) as embed(input_ids[:, start:end]) per chunk read, without grad. prepare(): what
    must happen before the embedding runs (a sharded engine gathers its weights: grad_sync.py)."""

    def __init__(self, embed: Callable, input_ids: torch.Tensor, like: torch.Tensor, prepare: Callable[[], None]):
        self.embed, self.input_ids, self.prepare = embed, input_ids, prepare
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device

    def chunks(self, bounds: Bounds) -> Iterator[torch.Tensor]:
        for start, end in bounds:
            self.prepare()
            with torch.no_grad():
                chunk = self.embed(self.input_ids[:, start:end])
            yield chunk

    def release(self) -> None:
        pass
