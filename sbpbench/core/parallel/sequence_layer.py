"""One decoder layer's chunked forward and backward when P ranks share the sequence (Ulysses):
the sequence-parallel LayerPasses (checkpoints.py), the counterpart of checkpoints.ChunkedPasses,
so stream.py runs either.

Each rank holds T_loc positions (sequence_shards.py); attention needs all T. Per layer:

1. **Keys/values in head space.** Chunk by chunk (first to last, in lockstep), each rank computes
   its chunk's keys/values (B, h_kv, c, hd) (the projection alone, key_values.py, or the layer up
   to its attention call) and `to_heads` sends them by head: every rank ends with its h_kv/P heads of
   all T positions, (B, h_kv/P, T_pad, hd), in global position order. With P > h_kv each K/V head
   is repeated P/h_kv times first, as Ulysses does, so each rank holds one.
2. **Query chunks.** The layer's own forward runs on each local chunk; its attention call sends the
   queries (B, H, c, hd) to head space (B, H/P, P c, hd), attends each rank's block over the keys
   before it (`offset_causal_attention`, lower-right aligned: one call per contiguous run of
   blocks) and sends the output back (B, H, c, hd). In the backward, chunks run last to first;
   the keys and values enter each chunk's graph as views of the head-space buffers whose gradient
   is added to fp32 sums (B, h_kv/P, T_pad, hd), and dX of the queries' path and of the residual
   and MLP overwrites dZ.
3. **Keys/values backward.** Once every chunk has run, the fp32 sums are complete; chunk by chunk,
   `to_positions` sends each rank its positions' dK/dV (summed over repeated heads), the keys and
   values are recomputed with a graph and backpropagated, and their dX is added.

The all-to-alls are collectives inside autograd: every rank runs the same chunks in the same
order (stream.py makes the ranks agree on T, the batch and the chunk size first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..architecture.key_values import LayerKeyValues
from ..attention import STATE_KWARG, ChunkAttention, KVCaptured, offset_causal_attention
from ..config import StreamConfig
from ..grad_accum import ChunkGradAccumulator
from ..layout import chunk_kwargs, window_start
from ..memory_kinds import KV_BUFFERS, KV_GRAD_SUMS
from ..phases import CHUNK_BACKWARD, CHUNK_FORWARD, KV_CAPTURE
from .sequence_group import SequenceParallel
from .sequence_shards import SequenceShards


@dataclass
class HeadSpaceKeys:
    """One layer's keys/values of all T_pad positions for this rank's K/V heads, (B, h, T_pad, hd)
    each, with their fp32 gradient sums in the backward."""

    keys: torch.Tensor
    values: torch.Tensor
    window: int | None
    grad_keys: torch.Tensor | None = None
    grad_values: torch.Tensor | None = None


class _BufferView(torch.autograd.Function):
    """buffer[:, :, start:end] as a view in a chunk's graph; its gradient is added to grad_sum.
    anchor: a 0-dim leaf that requires grad, so that autograd calls this backward."""

    @staticmethod
    def forward(ctx, anchor, buffer: list, grad_sum: list, start: int, end: int):
        ctx.grad_sum, ctx.start, ctx.end = grad_sum, start, end
        return buffer[0][:, :, start:end]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.grad_sum[0][:, :, ctx.start : ctx.end] += grad
        return None, None, None, None, None


@dataclass
class _HeadSpaceChunk:
    """The attention state of local chunk `index` (attention.py calls `attend_chunk`)."""

    index: int
    shards: SequenceShards
    group: SequenceParallel
    kv: HeadSpaceKeys
    attention: ChunkAttention
    anchor: torch.Tensor | None = None  # set in the backward: the buffers' views enter the graph

    def attend_chunk(self, query, key, value, scaling, sliding_window):
        """query (B, H, c, hd) of this rank's chunk -> (B, c, H, hd), the attention interface's layout."""
        queries = self.group.to_heads(query)  # (B, H/P, P c, hd): every rank's chunk, this rank's heads
        outs, offset = [], 0
        for start, end in self.shards.runs(self.index):
            key_start = window_start(start, sliding_window)
            run_queries = queries[:, :, offset : offset + end - start]  # (B, H/P, n, hd) at [start, end)
            keys, values = self._view(True, key_start, end), self._view(False, key_start, end)  # (B, h, m, hd)
            out = offset_causal_attention(
                run_queries, keys, values, query_start=start, key_start=key_start, scale=scaling,
                sliding_window=sliding_window, attention=self.attention,
            )  # fmt: skip
            outs.append(out)
            offset += end - start
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (B, H/P, P c, hd)
        return self.group.to_positions(out).transpose(1, 2).contiguous(), None

    def _view(self, keys: bool, start: int, end: int) -> torch.Tensor:
        buffer = self.kv.keys if keys else self.kv.values
        if self.anchor is None:
            return buffer[:, :, start:end]
        grad_sum = self.kv.grad_keys if keys else self.kv.grad_values
        return _BufferView.apply(self.anchor, [buffer], [grad_sum], start, end)


@dataclass
class _GraphKeys:
    """The attention state that takes a layer's keys/values (in its graph) and stops the layer."""

    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    window: int | None = None

    def attend_chunk(self, query, key, value, scaling, sliding_window):
        self.key, self.value, self.window = key, value, sliding_window
        raise KVCaptured


def _keys_through_layer(layer, call, hidden, sliced: dict, normed: torch.Tensor | None = None):
    """(keys, values, window) the layer hands its attention function for hidden (B, c, d), the layer
    run up to that call (`_GraphKeys` stops it); normed: input_layernorm's output replaced by it."""
    state = _GraphKeys()
    handle = None
    if normed is not None:
        handle = layer.input_layernorm.register_forward_hook(lambda module, args, output: normed)
    try:
        call(hidden, **sliced, **{STATE_KWARG: state})
    except KVCaptured:
        return state.key, state.value, state.window
    finally:
        if handle is not None:
            handle.remove()
    raise RuntimeError(f"{type(layer).__name__} never called its attention function")


class SequenceParallelStep:
    """The layer passes of one step under sequence parallelism (module docstring)."""

    def __init__(
        self, group: SequenceParallel, shards: SequenceShards, config: StreamConfig, attention: ChunkAttention
    ):
        self.group, self.shards = group, shards
        self.config, self.attention = config, attention

    # (B, h_kv, c, hd) -> (B, max(h_kv, P), c, hd): each K/V head once per rank that needs it
    def _replicated(self, tensor: torch.Tensor) -> torch.Tensor:
        world, heads = self.group.world, tensor.shape[1]
        return tensor if heads >= world else tensor.repeat_interleave(world // heads, dim=1)

    def _unreplicated(self, grad: torch.Tensor, heads: int) -> torch.Tensor:
        """(B, max(h_kv, P), c, hd) -> (B, h_kv, c, hd): the repeats' gradients summed."""
        if grad.shape[1] == heads:
            return grad
        return grad.view(grad.shape[0], heads, grad.shape[1] // heads, *grad.shape[2:]).sum(dim=2)

    def _project(self, layer, call, kwargs) -> LayerKeyValues:
        """hidden (B, c, d), sliced kwargs -> (keys, values, window) of the layer, in the graph
        where grad is enabled: the projection alone where it reproduces the layer's (key_values.py),
        or the layer run up to its attention call."""
        whole_layer = lambda hidden, sliced: _keys_through_layer(layer, call, hidden, sliced)
        return LayerKeyValues(layer, call, kwargs, whole_layer)

    def _keys_from_normed(self, keys_values: LayerKeyValues, layer, call):
        """(normed (B, c, d), the chunk's input, sliced kwargs) -> (keys, values), in the graph of
        `normed`: the verified projection after input_layernorm, or the layer run up to its
        attention call with input_layernorm's output replaced by `normed`."""
        project = keys_values.projection
        if project is not None:
            return lambda normed, hidden, sliced: project(normed, sliced, normed=True)[:2]
        return lambda normed, hidden, sliced: _keys_through_layer(layer, call, hidden, sliced, normed)[:2]

    def head_space_keys(self, layer, call, layer_input, kwargs, hooks, project=None) -> HeadSpaceKeys:
        """Step 1: every rank's keys/values, by head, no graph. project: the layer's LayerKeyValues."""
        project = project if project is not None else self._project(layer, call, kwargs)
        shards, kv = self.shards, None
        with torch.no_grad():
            for index, ((start, end), hidden) in enumerate(zip(shards.chunks, layer_input.chunks(shards.chunks))):
                key, value, window = project(hidden, chunk_kwargs(kwargs, start, end))  # (B, h_kv, c, hd)
                key = self.group.to_heads(self._replicated(key))  # (B, h, P c, hd), rank order
                value = self.group.to_heads(self._replicated(value))
                if kv is None:
                    batch, heads, _, dim = key.shape
                    with hooks.allocating(KV_BUFFERS):
                        kv = HeadSpaceKeys(
                            key.new_empty(batch, heads, shards.padded_len, dim),
                            value.new_empty(batch, heads, shards.padded_len, value.shape[-1]), window,
                        )  # fmt: skip
                offset = 0
                for block_start, block_end in shards.runs(index):
                    length = block_end - block_start
                    kv.keys[:, :, block_start:block_end] = key[:, :, offset : offset + length]
                    kv.values[:, :, block_start:block_end] = value[:, :, offset : offset + length]
                    offset += length
        return kv

    def forward(self, index: int, layer: nn.Module, call, source, sink, kwargs: dict) -> None:
        """X_{l+1} into sink from X_l, no graph (LayerPasses.forward)."""
        attention = self.attention
        kv = self.head_space_keys(layer, call, source, kwargs, attention.hooks)
        bounds = self.shards.chunks
        for index, ((start, end), hidden) in enumerate(zip(bounds, source.chunks(bounds))):
            state = _HeadSpaceChunk(index, self.shards, self.group, kv, attention)
            sink.write(start, end, call(hidden, **chunk_kwargs(kwargs, start, end), **{STATE_KWARG: state}))

    def backward(
        self, index: int, layer: nn.Module, call, layer_input, grad, kwargs: dict, *, need_input_grad: bool
    ) -> None:
        """dZ in grad becomes dX, the layer's parameter gradients in .grad (LayerPasses.backward)."""
        config, attention = self.config, self.attention
        hooks, shards = attention.hooks, self.shards
        norm = getattr(layer, "input_layernorm", None)
        if norm is None:
            raise ValueError(
                f"sequence-parallel StreamBP needs the layer's input_layernorm; {type(layer).__name__} has none"
            )
        keys_values = self._project(layer, call, kwargs)
        with hooks.timed(KV_CAPTURE):
            kv = self.head_space_keys(layer, call, layer_input, kwargs, hooks, keys_values)
            acc_dtype = torch.promote_types(kv.keys.dtype, torch.float32)
            with hooks.allocating(KV_GRAD_SUMS):
                kv.grad_keys = torch.zeros_like(kv.keys, dtype=acc_dtype)  # (B, h, T_pad, hd)
                kv.grad_values = torch.zeros_like(kv.values, dtype=acc_dtype)
                # the queries' gradient at input_layernorm's output, (B, T_loc, d), joined by the keys' and
                # values' in step 3 before the norm's backward, which computes in fp32: one sum, rounded once
                grad_normed = torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)
        accumulator = ChunkGradAccumulator(list(layer.parameters()), config.fp32_grad_accumulation, hooks.kinds)
        keys_of = self._keys_from_normed(keys_values, layer, call)  # the projection verified in step 1, if any
        self._query_chunks(
            layer, call, layer_input, grad, grad_normed, kwargs, kv, attention, need_input_grad, accumulator
        )
        for index, chunk in enumerate(layer_input.chunks(shards.chunks)):  # step 3, first to last
            start, end = shards.chunks[index]
            with hooks.timed(CHUNK_BACKWARD):
                grad_key, grad_value = self._position_grads(kv, index)  # (B, max(h_kv, P), c, hd) fp32
                chunk_input = chunk.detach().requires_grad_(need_input_grad)
                with torch.enable_grad():
                    normed = norm(chunk_input)  # (B, c, d)
                    cut = normed.detach().requires_grad_()  # the keys' and values' share gathers here
                    key, value = keys_of(cut, chunk.detach(), chunk_kwargs(kwargs, start, end))
                roots = [
                    (key, self._unreplicated(grad_key, key.shape[1]).to(key.dtype)),
                    (value, self._unreplicated(grad_value, value.shape[1]).to(value.dtype)),
                ]
                roots = [(root, g) for root, g in roots if root.requires_grad]
                if roots:
                    torch.autograd.backward([r for r, _ in roots], [g for _, g in roots])
                share = grad_normed[:, start:end] if cut.grad is None else grad_normed[:, start:end] + cut.grad
                if normed.requires_grad:  # the norm's backward (fp32 inside) once, on the whole sum
                    normed.backward(share)
                if need_input_grad and chunk_input.grad is not None:
                    (dx,) = grad.chunks([(start, end)])
                    grad.write(start, end, dx + chunk_input.grad)  # the norm's share of dX added
                accumulator.collect()
        with hooks.timed(CHUNK_BACKWARD):
            accumulator.finish()

    def _query_chunks(
        self, layer, call, layer_input, grad, grad_normed, kwargs, kv, attention, need_input_grad, accumulator
    ):
        """Step 2 of the backward: chunks last to first; dX of the residual path over dZ, the
        queries' gradient at input_layernorm's output into grad_normed."""
        hooks, shards = attention.hooks, self.shards
        order = list(reversed(range(len(shards.chunks))))
        bounds = [shards.chunks[index] for index in order]
        normed = []

        def cut(module, args, output):  # the norm's output as a leaf: its gradient stops there, kept
            normed.append(output.detach().requires_grad_())
            return normed[-1]

        handle = layer.input_layernorm.register_forward_hook(cut)
        try:
            for index, chunk, dz in zip(order, layer_input.chunks(bounds), grad.chunks(bounds)):
                start, end = shards.chunks[index]
                anchor = torch.zeros((), dtype=kv.keys.dtype, device=kv.keys.device, requires_grad=True)
                state = _HeadSpaceChunk(index, shards, self.group, kv, attention, anchor)
                chunk_input = chunk.detach().requires_grad_(need_input_grad)  # X[chunk] (B, c, d)
                normed.clear()
                with hooks.timed(CHUNK_FORWARD), torch.enable_grad():
                    output = call(chunk_input, **chunk_kwargs(kwargs, start, end), **{STATE_KWARG: state})
                with hooks.timed(CHUNK_BACKWARD):
                    torch.autograd.backward([output], [dz])  # the all-to-alls' backwards run on every rank alike
                    if normed and normed[0].grad is not None:
                        grad_normed[:, start:end] = normed[0].grad
                    if need_input_grad:
                        grad.write(start, end, chunk_input.grad)  # dX of the residual path, over dZ
                    accumulator.collect()
        finally:
            handle.remove()

    def _position_grads(self, kv: HeadSpaceKeys, index: int):
        """This rank's chunk `index` of the dK/dV sums: (B, max(h_kv, P), c, hd) each, from head space."""
        blocks = self.shards.runs(index)
        grads = []
        for total in (kv.grad_keys, kv.grad_values):
            parts = [total[:, :, start:end] for start, end in blocks]
            grads.append(self.group.to_positions(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)))
        return grads
