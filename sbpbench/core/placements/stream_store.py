"""The stream placements: nothing of length T x d on the device but one chunk at a time.

`stream:N` keeps N host buffers of one layer input each (B x T x d; `stream`: as many as every input
needs). One holds Z_L and then, in place, the gradient dZ / dX: the head reads each chunk of Z_L and
writes that chunk's dZ_L over it, and each layer's backward writes its dX chunks over dZ. The others
hold layer inputs X_1 .. X_{L-1}; X_0 is the embedding of the input ids, recomputed chunk by chunk
where it is read (sequences.py). Every read of a buffer moves chunks to the device on a side stream,
one chunk ahead of the loop that reads them, and every chunk written is copied back as it is made
(host_copies.py). So the device holds the layer's K/V buffers, their fp32 gradient sums and one
chunk's tensors, while the host holds N x B x T x d x s bytes.

Which inputs stay and which are rebuilt is binomial checkpointing (rebuild_schedule.py): the
checkpoint pass keeps the inputs the schedule keeps; the get of an input that is not kept advances
from the nearest kept one below, into a free buffer, overwriting it layer after layer (a layer's
forward reads each input chunk before writing that output chunk), keeping the inputs the schedule
says on the way; release frees a buffer.

During the checkpoint pass the decoder passes hidden states from layer to layer. Here those are
tokens: (B, T, d) tensors of no memory (stride 0) that stand for the host buffer holding the values.
The embedding returns one (its values are X_0, computed when read), each layer returns one for its
output, and the final norm's pre-hook receives the last. A layer must receive exactly the token the
one before returned, or the decoder did something to the hidden states in between: refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from ..cuda_calls import CUDA_CALLS, CudaCalls
from ..memory_kinds import KindListener
from .host_copies import Copier, CopyCounters
from .placement import Placement, RebuildInto
from .rebuild_schedule import schedule
from .sequences import EmbeddedSequence, HostSequence


class StreamingStore(CopyCounters):
    """The stream placements' store: the same calls as CheckpointStore (placement.py), each input a
    HostSequence (or X_0's EmbeddedSequence) instead of a device tensor.

    Counters as CheckpointStore's; `device_inputs` is always 0; `rebuilt` counts the layer forwards
    beyond the checkpoint pass's (rebuild_schedule.rebuilt_layers)."""

    def __init__(
        self,
        placement: Placement,
        num_layers: int,
        *,
        kinds: KindListener | None = None,
        shapes_only: bool = False,
        calls: CudaCalls = CUDA_CALLS,
    ):
        assert placement.stream, placement
        self.placement, self.num_layers = placement, num_layers
        self.num_buffers = placement.buffers(num_layers)
        self.rebuild_into: RebuildInto | None = None  # set before the first get that needs one (stream.py)
        self._copier = Copier(calls)
        self._calls = calls
        self.kinds, self.shapes_only = kinds, shapes_only
        self._kept: dict[int, HostSequence | EmbeddedSequence] = {}  # index -> the buffer keeping X_index
        self._advancing: HostSequence | None = None  # the pass's buffer between two kept inputs
        self.schedule = schedule(num_layers, self.num_buffers)
        self._grad: HostSequence | None = None  # Z_L, then the gradient in place
        self._tokens: dict[int, torch.Tensor] = {}  # the pass: index -> the token standing for X_index
        self._buffers: list[HostSequence] = []  # every buffer taken and not handed back
        self.device_inputs = self.max_device_inputs = 0
        self.host_bytes = self.max_host_bytes = 0
        self.rebuilt = 0

    def _take(self, like: torch.Tensor | HostSequence | EmbeddedSequence) -> HostSequence:
        buffer = HostSequence(
            self._copier, like.shape, like.dtype, like.device, shapes_only=self.shapes_only, kinds=self.kinds
        )
        assert len(self._buffers) < self.num_buffers, "more host buffers than the placement allows"
        self._buffers.append(buffer)
        self.host_bytes += buffer.nbytes
        self.max_host_bytes = max(self.max_host_bytes, self.host_bytes)
        return buffer

    def _give(self, buffer: HostSequence) -> None:
        self._buffers.remove(buffer)
        self.host_bytes -= buffer.nbytes
        buffer.release()

    # -- checkpoint pass -------------------------------------------------------------------------

    @contextmanager
    def passing(self, parts, input_ids: torch.Tensor, prepare_embedding: Callable[[], None]) -> Iterator[None]:
        """For the duration of the checkpoint pass the embedding returns a token for X_0 and computes
        nothing (its forward is wrapped on the instance, hooks still run; restored whatever happens).
        X_0's values are computed chunk by chunk when read. prepare_embedding: before each such
        embedding (a sharded engine gathers its weights)."""
        embed = parts.embed
        forward = embed.forward  # the module's own (or what was on the instance before)
        previous = embed.__dict__.get("forward")

        def tokened(ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if args or kwargs or ids is not input_ids:
                raise RuntimeError("the stream placement expects the decoder to embed the step's input ids as given")
            first = forward(ids[:, :1])  # (B, 1, d): the dtype, width and device of X_0, one position
            self._kept[0] = EmbeddedSequence(forward, ids, _token(first, ids.shape[1]), prepare_embedding)
            return self._new_token(0, first, ids.shape[1])

        embed.forward = tokened
        try:
            with torch.no_grad():
                yield
        finally:
            if previous is None:
                del embed.forward
            else:
                embed.forward = previous

    def _new_token(self, index: int, like: torch.Tensor, seq_len: int) -> torch.Tensor:
        token = self._tokens[index] = _token(like, seq_len)
        return token

    def _check_token(self, index: int, hidden: torch.Tensor, where: str) -> None:
        if self._tokens.get(index) is not hidden:
            raise RuntimeError(
                f"the stream placement: {where} got hidden states that the layer before did not return (a forward "
                f"hook or the decoder changed them in between); use another --checkpoints placement"
            )

    def forward_layer(
        self, index: int, layer_input: torch.Tensor, run, kept: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The checkpoint pass through layer `index`: run(source, sink) from X_index's buffer into
        X_{index+1}'s (binomial schedule: in place, a free buffer, or the gradient's for Z_L);
        returns the token for X_{index+1}. A pre-hook that changed the layer's input (layer_input
        is not the token `kept` was) is refused: the chunks are read from the buffer."""
        self._check_token(index, layer_input, f"decoder layer {index}")
        source = self._kept.get(index, self._advancing)
        assert source is not None, f"X_{index} is nowhere"
        last = index + 1 == self.num_layers
        sink = self._advancing if source is self._advancing and not last else self._take(source)
        run(source, sink)
        if last:
            self._grad, self._advancing = sink, None
        elif index + 1 in self.schedule.pass_kept:
            self._kept[index + 1], self._advancing = sink, None
        else:
            self._advancing = sink
        return self._new_token(index + 1, layer_input, layer_input.shape[1])

    def last_hidden(self, last_hidden: torch.Tensor) -> HostSequence:
        """Z_L as the head reads it: the buffer the pass's last layer wrote."""
        self._check_token(self.num_layers, last_hidden, "the final norm")
        self._tokens.clear()
        return self._grad

    def head_grad(self, last_hidden: HostSequence) -> HostSequence:
        """Where the head writes dZ_L: over Z_L, chunk by chunk, as it reads it."""
        return last_hidden

    # -- layer loop ------------------------------------------------------------------------------

    def get(self, index: int, device: torch.device) -> HostSequence | EmbeddedSequence:
        """X_index; where it is not kept, rebuilt from the nearest kept input below, keeping on the
        way what the schedule says (module docstring)."""
        for start, end in self.schedule.advances[index]:
            source = self._kept[start]
            sink = self._take(source)  # overwritten layer after layer, then keeps X_end
            for layer in range(start, end):
                self._rebuild(layer, source, sink)
                source = sink
            self._kept[end] = sink
        return self._kept[index]

    def _rebuild(self, layer: int, source, sink: HostSequence) -> None:
        assert self.rebuild_into is not None, "a rebuilding store needs its rebuild function"
        self.rebuild_into(layer, source, sink)
        self.rebuilt += 1

    def release(self, index: int) -> None:
        """X_index's layer is done: its buffer goes back to the pool once no copy uses it."""
        kept = self._kept.pop(index, None)
        if isinstance(kept, HostSequence):
            self._give(kept)

    def close(self) -> None:
        """Hand every buffer back (all of them after an error) once no copy uses it; then the pool
        keeps what this step used (host_pool.py, "Policy")."""
        self._copier.synchronize()
        self._kept.clear()
        self._tokens.clear()
        self._advancing = self._grad = None
        for buffer in list(self._buffers):
            self._give(buffer)
        if self.pins_host_memory:
            self._calls.pool.trim()


def _token(like: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A (B, seq_len, d) tensor of like's dtype and device, with no memory behind its positions."""
    shape = (like.shape[0], seq_len, *like.shape[2:])
    return torch.empty_strided(shape, (0,) * len(shape), dtype=like.dtype, device=like.device)
