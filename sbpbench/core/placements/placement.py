"""Where StreamBP keeps its checkpoints, the layer inputs X_l (B, T, d): core/README.md, "Where the
checkpoints live".

At long T the checkpoints are nearly all of StreamBP's memory ((L+1) x d x s bytes per token), while
the step is attention-bound. A placement trades them for host memory or compute, never for a
different result: every placement runs the same operations on the same values.

    gpu                every X_l on the device from the checkpoint pass until its layer is done (default)
    cpu                every X_l copied to host memory (pinned on CUDA, on a side stream) as the
                       checkpoint pass makes it; brought back one layer ahead of its backward, so at
                       most two layer inputs are on the device at a time
    recompute:K        keep X_l for l = 0, K, 2K, ...; when the backward reaches a segment
                       [s, s + K), rebuild X_{s+1} .. from X_s with the checkpoint pass's chunked
                       no-grad layer forward (one more forward of those layers)
    cpu+recompute:K    the kept inputs on the host, each segment rebuilt on the device
    cpu+recompute:K+spill
                       as cpu+recompute:K, but a segment's rebuilt inputs go to the host as they are
                       made, except the top two; brought back one layer ahead like cpu's, so the
                       device holds at most two layer inputs at a time (cpu's) for K - 3 more
                       host copies than cpu+recompute:K
    stream             no layer input, no Z_L and no gradient dZ / dX whole on the device: each lives
                       in a host buffer and moves to the device a chunk at a time (stream_store.py)
    stream:N           as stream with at most N such host buffers, the gradient's included; the
                       inputs that do not fit are rebuilt, as few as binomial checkpointing needs
                       (rebuild_schedule.py)

`CheckpointStore` is what the checkpoint pass `put`s every layer input into and the layer loop
`get`s and `release`s them from, last layer first; `StreamingStore` (stream_store.py) serves stream.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from ..cuda_calls import CUDA_CALLS, CudaCalls
from ..host_pool import HostBuffer
from ..memory_kinds import CHECKPOINTS, KindListener, allocating, note
from .host_copies import Copier, CopyCounters
from .rebuild_schedule import every_input_buffers
from .sequences import DeviceSequence

# K: a positive integer; N: an integer >= 2
PLACEMENTS = ("gpu", "cpu", "recompute:K", "cpu+recompute:K", "cpu+recompute:K+spill", "stream", "stream:N")


@dataclass(frozen=True)
class Placement:
    offload: bool = False  # kept inputs live in host memory
    recompute_every: int = 1  # keep X_l when l % recompute_every == 0; 1 keeps every one
    spill: bool = False  # rebuilt inputs go to the host too (offload and recompute_every > 1 only)
    stream: bool = False  # inputs, Z_L and the gradient in host buffers, moved chunk by chunk
    host_buffers: int | None = None  # stream:N, the most host buffers; None: one per layer input

    @classmethod
    def parse(cls, text: str | Placement) -> Placement:
        """ "gpu", "cpu", "recompute:K", "cpu+recompute:K", "cpu+recompute:K+spill" (K >= 1;
        recompute:1 is gpu), words in any order; "stream", "stream:N" (N >= 2) alone."""
        if isinstance(text, Placement):
            return text
        words = str(text).strip().lower().split("+")
        if len(words) == 1 and (words[0] == "stream" or words[0].startswith("stream:")):
            return cls._stream(words[0], text)
        offload, every, spill = False, 1, False
        for word in words:
            if word == "cpu" and not offload:
                offload = True
            elif word == "gpu" and len(words) == 1:
                pass
            elif word == "spill" and not spill:
                spill = True
            elif word.startswith("recompute:") and every == 1 and word[10:].isdigit() and int(word[10:]) >= 1:
                every = int(word[10:])
            else:
                raise ValueError(
                    f"checkpoints must be one of {', '.join(PLACEMENTS)} (K a positive integer, N >= 2), got {text!r}"
                )
        if spill and not (offload and every > 1):
            raise ValueError(
                f"spill moves rebuilt inputs to the host: use it as cpu+recompute:K+spill with K >= 2, got {text!r}"
            )
        return cls(offload, every, spill)

    @classmethod
    def _stream(cls, word: str, text) -> Placement:
        if word == "stream":
            return cls(stream=True)
        number = word.removeprefix("stream:")
        if not number.isdigit() or int(number) < 2:
            raise ValueError(
                f"stream:N keeps at most N layer inputs in host memory, the gradient's included: N >= 2, got {text!r}"
            )
        return cls(stream=True, host_buffers=int(number))

    def __str__(self) -> str:
        return self.name

    @property
    def name(self) -> str:
        if self.stream:
            return "stream" if self.host_buffers is None else f"stream:{self.host_buffers}"
        parts = (["cpu"] if self.offload else []) + (
            [f"recompute:{self.recompute_every}"] if self.recompute_every > 1 else []
        )
        return "+".join(parts + (["spill"] if self.spill else [])) or "gpu"

    def kept(self, index: int) -> bool:
        return index % self.recompute_every == 0

    def buffers(self, num_layers: int) -> int:
        """stream: the host buffers a model of num_layers uses (N, or fewer where one per input is fewer)."""
        every = every_input_buffers(num_layers)
        return every if self.host_buffers is None else min(self.host_buffers, every)

    def host_inputs(self, num_layers: int) -> int:
        """Most layer inputs the host holds at once: the kept ones, plus with spill a full segment's
        rebuilt inputs below its top two; stream: its buffers (the gradient's among them)."""
        if self.stream:
            return self.buffers(num_layers)
        if not self.offload:
            return 0
        kept = -(-num_layers // self.recompute_every)
        return kept + (max(0, min(self.recompute_every, num_layers) - 3) if self.spill else 0)


# rebuild_into(l, source, sink): X_{l+1} into sink from X_l read from source, chunk by chunk, no grad
RebuildInto = Callable[[int, object, object], None]


class CheckpointStore(CopyCounters):
    """The layer inputs of one step. put(l, X_l) during the checkpoint pass, layers first to last;
    then get(l) / release(l) for l = L-1 down to 0, each get before its release; close() at the end
    (also after an error).

    calls: the CUDA runtime as the store uses it (cuda_calls.py): the process's CUDA_CALLS, whose
    pool of page-locked host buffers outlives the store; tests pass a recording stand-in.

    Counters, for tests, rows and the estimator: `device_inputs` (layer inputs the store holds on
    the device now) and `max_device_inputs`; `host_bytes` / `max_host_bytes` (host copies held);
    `transfer_bytes` (moved host <-> device, both directions); `pins_host_memory` (its host copies
    are page-locked buffers of the pool) and `host_register_s` (seconds spent registering buffers
    the pool did not have: the first step's cost, 0.0 once the pool holds them).

    timer: set by the step (stream.py) to time its copies (on the side stream on CUDA) and the
    compute stream's waits for them (phases.py). kinds: a memory-kind listener told that what the
    store holds is checkpoints (memory_kinds.py). shapes_only: host copies keep only shape and
    dtype, for the memory simulator, whose fake tensors have no values to copy and whose count must
    not charge host copies to the device."""

    def __init__(
        self,
        placement: Placement,
        num_layers: int,
        *,
        kinds: KindListener | None = None,
        shapes_only: bool = False,
        calls: CudaCalls = CUDA_CALLS,
    ):
        self.placement = placement
        self.num_layers = num_layers
        self.kinds, self.shapes_only = kinds, shapes_only
        self.rebuild_into: RebuildInto | None = None  # set before the first get that needs one (stream.py)
        self._copier = Copier(calls)
        self._calls = calls
        self._device: dict[int, torch.Tensor] = {}  # kept or rebuilt inputs on the device
        self._host: dict[int, torch.Tensor] = {}  # offloaded inputs, until their layer is done
        self._buffers: dict[int, HostBuffer] = {}  # the pool's page-locked buffers under _host
        self._arrived: dict = {}  # index -> event: the copy back to the device is done
        self.max_device_inputs = 0
        self.host_bytes = self.max_host_bytes = 0

    @property
    def device_inputs(self) -> int:
        return len(self._device)

    def _count(self) -> None:
        self.max_device_inputs = max(self.max_device_inputs, len(self._device))
        self.max_host_bytes = max(self.max_host_bytes, self.host_bytes)

    # -- checkpoint pass -------------------------------------------------------------------------

    def passing(self, parts, input_ids: torch.Tensor, prepare_embedding) -> AbstractContextManager:
        """The checkpoint pass runs in this context (nothing to arrange: the decoder's own embedding)."""
        return nullcontext()

    def forward_layer(
        self, index: int, layer_input: torch.Tensor, run, kept: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The checkpoint pass through layer `index`: X_l put (`kept`: the input the layer was
        called with, before its pre-hooks made `layer_input`), run(source, sink) chunk by chunk
        from layer_input into X_{l+1}, which goes back to the decoder."""
        self.put(index, layer_input if kept is None else kept)
        with allocating(self.kinds, CHECKPOINTS):
            output = torch.empty_like(layer_input)  # becomes X_{l+1}
        run(DeviceSequence(layer_input), DeviceSequence(output))
        return output

    def put(self, index: int, layer_input: torch.Tensor) -> None:
        """X_l as the checkpoint pass made it: kept on the device, copied to the host, or dropped
        (rebuilt later)."""
        if not self.placement.kept(index):
            return
        note(self.kinds, CHECKPOINTS, layer_input)  # X_0 is the embedding's output, made before the pass could say
        if not self.placement.offload:
            self._device[index] = layer_input
        else:
            self._copy_out(index, layer_input)
        self._count()

    def _copy_out(self, index: int, layer_input: torch.Tensor) -> None:
        """Keep a host copy of X_index: pinned and copied on the side stream on CUDA."""
        if self.shapes_only:
            self._host[index] = _HostShape(layer_input.shape, layer_input.dtype, layer_input.nbytes)
            self._copier.to_host_bytes += layer_input.nbytes
        elif self._copier.overlaps(layer_input.device):  # host memory: no device allocation to tell of
            buffer = self._buffers[index] = self._copier.take_buffer(layer_input.nbytes)
            host = buffer.view(layer_input.shape, layer_input.dtype)
            self._copier.to_host(host, layer_input)
            self._host[index] = host
        else:  # an ordinary copy off a GPU
            with allocating(self.kinds, CHECKPOINTS):  # on a CPU: in the memory counted
                host = self._host[index] = torch.empty(layer_input.shape, dtype=layer_input.dtype)
            self._copier.to_host(host, layer_input)
        self.host_bytes += layer_input.nbytes

    # -- layer loop ------------------------------------------------------------------------------

    def last_hidden(self, last_hidden: torch.Tensor) -> DeviceSequence:
        """Z_L as the head reads it: the decoder's tensor, on the device."""
        return DeviceSequence(last_hidden)

    def head_grad(self, last_hidden: DeviceSequence) -> DeviceSequence:
        """Where the head writes dZ_L: zeros on the device, like Z_L."""
        return DeviceSequence(torch.zeros_like(last_hidden.tensor), zeroed=True)

    def _segment_start(self, index: int) -> int:
        return index - index % self.placement.recompute_every

    def _prefetch(self, index: int, device: torch.device) -> None:
        """Start bringing X_index (kept or spilled) back to the device (a no-op unless it is on the
        host and not on the device already)."""
        if index < 0 or index in self._device or index not in self._host:
            return
        host = self._host[index]
        with allocating(self.kinds, CHECKPOINTS):
            target = self._bring_back(index, host, device)
        self._device[index] = target
        self._count()

    def _bring_back(self, index: int, host, device: torch.device) -> torch.Tensor:
        """A device copy of the host copy of X_index, on its way (a side stream on CUDA)."""
        if self.shapes_only:
            target = torch.empty(host.shape, dtype=host.dtype, device=device)
            self._copier.to_device_bytes += host.nbytes
        else:
            # the copy runs while the current layer's backward does (host_copies.py)
            target, event = self._copier.to_device(host, device)
            if event is not None:
                self._arrived[index] = event
        return target

    def get(self, index: int, device: torch.device) -> DeviceSequence:
        """X_index on `device`. The first get of a segment [s, s + K) (its last layer) brings X_s
        and rebuilds the rest; the get of X_s sets the previous segment's kept input on its way,
        to arrive while layer s's backward runs. With spill the rebuild sends each input below
        X_{index-1} to the host once the next is made, and every get sets X_{index-1} on its way."""
        start = self._segment_start(index)
        if index not in self._device:
            if index not in self._host:  # the top of a segment: rebuild it
                self._prefetch(start, device)
                self._wait(start, device)
                self._rebuild_segment(start, index)
            self._prefetch(index, device)  # on the host and not on its way yet: the backward's first get
        self._wait(index, device)
        if index == start:
            self._prefetch(start - self.placement.recompute_every, device)
        elif self.placement.spill:
            self._prefetch(index - 1, device)
        return DeviceSequence(self._device[index])

    def _rebuild_segment(self, start: int, top: int) -> None:
        """X_{start+1} .. X_top from X_start. Spill: keep only X_{top-1} and X_top on the device;
        X_start's device copy goes (its host copy stays), the others below X_{top-1} are copied out."""
        assert self.rebuild_into is not None, "a recomputing store needs its rebuild function"
        for layer in range(start, top):
            source = self._device[layer]
            with allocating(self.kinds, CHECKPOINTS):
                output = torch.empty_like(source)
            self.rebuild_into(layer, DeviceSequence(source), DeviceSequence(output))
            self._device[layer + 1] = output
            self._count()
            if self.placement.spill and layer < top - 1:
                made = self._device.pop(layer)
                if layer != start:
                    self._copy_out(layer, made)
                    self._count()

    def _wait(self, index: int, device: torch.device) -> None:
        self._copier.arrive(self._arrived.get(index), device)

    def release(self, index: int) -> None:
        """X_index is no longer needed (its layer's backward is done): free it, and hand its host
        buffer back to the pool."""
        self._device.pop(index, None)
        host = self._host.pop(index, None)
        if host is None:
            return
        self.host_bytes -= host.nbytes
        buffer = self._buffers.pop(index, None)
        if buffer is not None:
            # the copy back from these pages is done (long since: a layer ago)
            self._copier.give_buffer(buffer, self._arrived.pop(index, None))

    def close(self) -> None:
        """Free everything still held (all of it after an error), handing host buffers back once no
        copy uses them; then the pool keeps what this step used (host_pool.py, "Policy")."""
        self._copier.synchronize()
        for index in list(self._host) + list(self._device):
            self.release(index)
        if self.pins_host_memory:
            self._calls.pool.trim()


@dataclass(frozen=True)
class _HostShape:
    """A host copy of a store made with shapes_only: what it would hold, not the values."""

    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
