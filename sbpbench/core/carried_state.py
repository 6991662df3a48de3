"""Layers whose token mixer carries a state from position to position instead of attending:
linear attention (GatedDeltaNet), Mamba-2's SSD scan, short causal convolutions; and layers that
mix no positions at all (an MLP block of its own). core/README.md, "Layers that carry a state".

transformers' mixers read and write their state through the cache they are given: the conv tail
(the last K inputs of the causal convolution, B x C x K) and the recurrent state (GatedDeltaNet:
B x H x d_k x d_v; Mamba-2: B x H x d_head x d_state). `StateCarry` stands in for that cache, so
the model's own code runs chunk by chunk, each chunk starting from the states the chunk before left:

    checkpoint pass   chunks first to last, the states carried (no graph)
    layer backward    1. chunks first to last, no graph: each chunk's start states, kept
                      2. chunks last to first: the chunk's forward from its start states as leaves;
                         one backward with roots (output, dZ[chunk]) and (the states it leaves,
                         their gradient from the chunk after); the start states' gradient goes to
                         the chunk before

The states' gradients are those of the whole-sequence forward because each chunk's computation
is the model's own from the same inputs (the chain rule split at the chunk boundaries, as for the
keys and values of attention). K/V of attention layers do not travel through it: `update` returns
them as given (StreamBP splices the prefix itself, attention.py).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from .architecture.detectors import carries_state
from .grad_accum import ChunkGradAccumulator
from .layout import chunk_bounds, chunk_kwargs
from .memory_kinds import CARRIED_STATES
from .phases import CHUNK_BACKWARD, CHUNK_FORWARD, KV_CAPTURE


class StateCaptured(Exception):
    """Raised once a chunk's mixer has left its recurrent state: the rest of the layer is not needed
    to know the next chunk's start states."""


class StateCarry:
    """The cache a state-carrying mixer is given for one layer's chunks (module docstring):
    `conv` (B, C, K) and `recurrent` hold what the chunk before left; `updates` counts the state
    writes of the chunk running (the checkpoint pass checks them); capture: stop the layer once
    the recurrent state is written."""

    def __init__(self, conv: torch.Tensor | None = None, recurrent: torch.Tensor | None = None, capture: bool = False):
        self.conv, self.recurrent, self.capture = conv, recurrent, capture
        self.updates = 0

    # -- transformers' cache interface, as its mixers call it --------------------------------------

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # never the single-token path that updates the conv state in place

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        """conv_states (B, C, c), this chunk's conv inputs -> the tail before them and them, (B, C, K + c)
        (a chunk without one: them); the last K kept for the next chunk, zeros where there were fewer."""
        kernel = kwargs.get("conv_kernel_size") or conv_states.shape[-1]
        full = conv_states if self.conv is None else torch.cat([self.conv, conv_states], dim=-1)
        tail = full[..., -kernel:]
        if tail.shape[-1] < kernel:  # fewer inputs so far than the kernel: the zeros of its causal padding
            tail = nn.functional.pad(tail, (kernel - tail.shape[-1], 0))
        self.conv = tail
        self.updates += 1
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int = 0, state_idx: int = 0, **kw):
        self.recurrent = recurrent_states
        self.updates += 1
        if self.capture:
            raise StateCaptured
        return recurrent_states

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """An attention layer's keys and values pass through: StreamBP carries its prefix itself."""
        return key_states, value_states


def _start_states(call, layer_input, kwargs: dict, chunks) -> list[tuple]:
    """Step 1: the (conv tail, recurrent state) each chunk starts from, no graph, first to last."""
    starts, carry = [], StateCarry(capture=True)
    with torch.no_grad():
        for (start, end), hidden in zip(chunks, layer_input.chunks(chunks)):
            starts.append((carry.conv, carry.recurrent))
            try:
                call(hidden, **{**chunk_kwargs(kwargs, start, end), "cache": carry})
            except StateCaptured:
                pass
    return starts


def _leaf(state: torch.Tensor | None) -> torch.Tensor | None:
    return None if state is None else state.detach().requires_grad_()


def carried_layer_backward(
    layer: nn.Module,
    layer_input,
    grad,
    kwargs: dict,
    *,
    config,
    attention,
    need_input_grad: bool,
    call=None,
    layout=None,
    router=None,
) -> None:
    """layer_backward.layer_backward for a layer without attention (module docstring): the same
    arguments; layout must be None (left padding and packed rows are refused for such models)."""
    assert layout is None, "a state-carrying layer with a padding layout"
    call = layer if call is None else call
    hooks = attention.hooks
    seq_len = layer_input.shape[1]
    chunks = chunk_bounds(seq_len, config.chunk_size)
    carries = carries_state(layer)
    with hooks.timed(KV_CAPTURE), hooks.allocating(CARRIED_STATES):
        starts = _start_states(call, layer_input, kwargs, chunks) if carries else [(None, None)] * len(chunks)
    accumulator = ChunkGradAccumulator(list(layer.parameters()), config.fp32_grad_accumulation, hooks.kinds)
    backward_order = list(reversed(chunks))
    inputs, grads = layer_input.chunks(backward_order), grad.chunks(backward_order)
    later: list[tuple[torch.Tensor, torch.Tensor]] = []  # the start states of the chunk after, with their gradient
    for index in reversed(range(len(chunks))):
        start, end = chunks[index]
        conv, recurrent = (_leaf(state) for state in starts[index])
        carry = StateCarry(conv, recurrent) if carries else None
        chunk_input = next(inputs).detach().requires_grad_(need_input_grad)  # X[chunk] (B, c, d)
        routed = nullcontext() if router is None else router.capturing()
        extra = {} if carry is None else {"cache": carry}
        with hooks.timed(CHUNK_FORWARD), torch.enable_grad(), routed:
            output = call(chunk_input, **{**chunk_kwargs(kwargs, start, end), **extra})  # (B, c, d)
        with hooks.timed(CHUNK_BACKWARD):
            roots, root_grads = [output], [next(grads)]
            if carry is not None:  # the states this chunk leaves, and what the chunk after made of them
                for left, (_, state_grad) in zip((carry.conv, carry.recurrent), later):
                    if left is not None and state_grad is not None:
                        roots.append(left)
                        root_grads.append(state_grad.to(left.dtype))
            if router is not None:
                router_roots, router_grads = router.roots(start, end)
                roots, root_grads = roots + router_roots, root_grads + router_grads
            pairs = [(r, g) for r, g in zip(roots, root_grads) if r.requires_grad]
            if pairs:
                torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
            if need_input_grad:
                grad.write(start, end, chunk_input.grad)
            accumulator.collect()
            later = [(state, None if state is None else state.grad) for state in (conv, recurrent)]
            del carry, output
        starts[index] = (None, None)  # this chunk's start states are spent
    with hooks.timed(CHUNK_BACKWARD):
        accumulator.finish()
