"""Backward through one decoder layer, chunk by chunk along the sequence (core/README.md, "Layer backward").

1. Keys/values of all T positions are recomputed from X_l once, without grad, into buffers
   (B, kv_heads, T, head_dim) - small under GQA.
2. Chunks run last to first through the layer's own forward. The chunk's queries attend to the
   buffered prefix and to the chunk's own keys and values (in the graph). The prefix is a view of
   the buffers whose gradient is added to fp32 dK/dV sums for earlier positions. The backward
   roots are (output, dZ[chunk]) plus (chunk keys/values, dK/dV accumulated from later chunks).
   Going last to first makes a chunk's dK/dV complete before it runs. So each position's K/V
   projections are recomputed once per layer backward, not once per later chunk as in the
   official code.
3. dX[chunk] is final once its chunk is done and overwrites dZ[chunk] in place.
X and dZ / dX are read and written a chunk at a time (sequences.py): on the device, or from and to
host memory one chunk ahead (the stream placement).

Shapes: B rows, T positions, d hidden size, c = end - start positions of a chunk, kv = key/value
heads (before GQA repetition), h = head_dim.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from .architecture.key_values import LayerKeyValues, Projection
from .attention import STATE_KWARG, ChunkAttention, ChunkState, KVBuffer, KVCaptured, chunk_plan
from .config import StreamConfig
from .grad_accum import ChunkGradAccumulator
from .layout import SequenceLayout, chunk_bounds, chunk_kwargs
from .memory_kinds import KV_GRAD_SUMS
from .objectives.router_loss import RouterBalance
from .phases import CHUNK_BACKWARD, CHUNK_FORWARD, KV_CAPTURE


def whole_layer_keys_values(call, attention: ChunkAttention) -> Projection:
    """The keys/values of a chunk by running the layer until its attention function has stored them
    (the layer stops there, `KVCaptured`): what every projection must reproduce (key_values.py)."""

    def project(hidden: torch.Tensor, chunk_kwargs: dict):
        capture = KVBuffer(seq_len=hidden.shape[1], attend=False, attention=attention)
        try:
            call(hidden, **chunk_kwargs, **{STATE_KWARG: capture})
        except KVCaptured:
            return capture.keys, capture.values, capture.sliding_window
        raise RuntimeError(f"{type(getattr(call, '__self__', call)).__name__} never called its attention function")

    return project


def _capture_keys_values(layer, call, layer_input, kwargs: dict, chunks, attention: ChunkAttention) -> KVBuffer:
    """layer_input: X (sequences.py), read first chunk to last. The keys/values alone where a
    projection reproduces the layer's (key_values.py), else by running the layer on each chunk
    until its attention function has stored them."""
    capture = KVBuffer(seq_len=layer_input.shape[1], attend=False, attention=attention)  # keys, values (B, kv, T, h)
    keys_values = LayerKeyValues(layer, call, kwargs, whole_layer_keys_values(call, attention))
    with torch.no_grad():
        for (start, end), hidden in zip(chunks, layer_input.chunks(chunks)):
            capture.start = start
            if attention.hooks.on_capture is not None:
                attention.hooks.on_capture(capture)
            capture.store(*keys_values(hidden, chunk_kwargs(kwargs, start, end)))
    return capture


def layer_backward(
    layer: nn.Module,
    layer_input,
    grad,
    kwargs: dict,
    *,
    config: StreamConfig,
    attention: ChunkAttention,
    need_input_grad: bool,
    call=None,
    layout: SequenceLayout | None = None,
    router: RouterBalance | None = None,
) -> None:
    """layer_input X (B, T, d); grad dZ (B, T, d) is overwritten with dX when need_input_grad (both
    sequences.py: read and written chunk by chunk). Leaves the layer's parameter gradients in .grad. call: what runs a chunk, `layer` itself unless
    a data-parallel engine needs its hook-free `forward` (grad_sync.py). layout: the batch's padding
    and packed documents (layout.py), None when each row is one sequence from position 0.
    router: a mixture-of-experts model's load-balancing term (objectives/router_loss.py), whose
    gradient each chunk's router logits get as one more root.
    config: the chunk size and the gradient sums' dtype; attention: the chunks' kernel setting and
    the step's hooks (their timer times K/V capture, chunk forward and chunk backward, phases.py)."""
    call = layer if call is None else call
    hooks = attention.hooks
    seq_len = layer_input.shape[1]  # layer_input, grad: (B, T, d)
    chunks = chunk_bounds(seq_len, config.chunk_size)  # [(start, end), ...] covering [0, T)
    with hooks.timed(KV_CAPTURE):
        capture = _capture_keys_values(layer, call, layer_input, kwargs, chunks, attention)
        keys, values, window = capture.keys, capture.values, capture.sliding_window  # (B, kv, T, h) each
        acc_dtype = torch.promote_types(keys.dtype, torch.float32)  # dK/dV sum over later chunks
        with hooks.allocating(KV_GRAD_SUMS):
            grad_keys = torch.zeros_like(keys, dtype=acc_dtype)  # (B, kv, T, h), fp32 (fp64 for an fp64 model)
            grad_values = torch.zeros_like(values, dtype=acc_dtype)  # (B, kv, T, h)
    accumulator = ChunkGradAccumulator(list(layer.parameters()), config.fp32_grad_accumulation, hooks.kinds)

    backward_order = list(reversed(chunks))  # last chunk first: its dK/dV from later chunks are complete
    # each chunk taken where it is first read: a host copy is waited for just before its use
    inputs, grads = layer_input.chunks(backward_order), grad.chunks(backward_order)
    for start, end in backward_order:
        state = ChunkState(start, chunk_plan(layout, start, end, window), capture, grad_keys, grad_values)
        chunk_input = next(inputs).detach().requires_grad_(need_input_grad)  # X[chunk] (B, c, d), a leaf
        routed = nullcontext() if router is None else router.capturing()
        with (
            hooks.timed(CHUNK_FORWARD),
            torch.enable_grad(),
            routed,
        ):  # queries (B, heads, c, h) against keys[..., :end, :]
            output = call(chunk_input, **chunk_kwargs(kwargs, start, end), **{STATE_KWARG: state})  # (B, c, d)

        with hooks.timed(CHUNK_BACKWARD):
            roots, root_grads = [output], [next(grads)]  # dZ[chunk] (B, c, d)
            if end < seq_len:  # later chunks attended to this chunk's keys/values: (B, kv, c, h) each
                roots += [state.key_chunk, state.value_chunk]
                root_grads += [grad_keys[:, :, start:end].to(keys.dtype), grad_values[:, :, start:end].to(values.dtype)]
            if router is not None:  # the load-balancing loss's gradient at the chunk's router logits
                router_roots, router_grads = router.roots(start, end)
                roots, root_grads = roots + router_roots, root_grads + router_grads
            pairs = [(r, g) for r, g in zip(roots, root_grads) if r.requires_grad]
            if pairs:  # the prefix's dK/dV go into grad_keys/grad_values[:, :, :start] on the way (_BufferedPrefix)
                torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
            if need_input_grad:
                grad.write(start, end, chunk_input.grad)  # dX[chunk] (B, c, d) over dZ[chunk], now spent
            accumulator.collect()  # this chunk's weight gradients into the (fp32) sums
    with hooks.timed(CHUNK_BACKWARD):
        accumulator.finish()  # the sums into .grad, rounded once
