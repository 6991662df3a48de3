"""The checkpoint pass: the model's own forward without an autograd graph, keeping each decoder
layer's input X_l (B, T, d), where the placement keeps it (placement.py), and the keyword arguments
the model passed to it.

The decoder runs as usual (its embedding, Gemma-3's per-layer-type RoPE, everything model
specific stays the model's), but while it runs each layer's `forward` is wrapped, on the
instance and only for the duration of the pass, so that the layer runs `chunk_size` positions
at a time through its own code, attending over a key/value buffer of the positions before
(`KVBuffer(attend=True)`). The forward therefore never holds a whole-sequence MLP intermediate
(B x T x intermediate_size: several GiB at 100k tokens), only one chunk's. The recorded arguments
let the backward call the same layer the same way, sliced to a chunk's positions
(layout.chunk_kwargs). core/README.md, "Checkpoint pass".
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch
from torch import nn

from .architecture.detectors import carries_state
from .architecture.parts import DecoderParts, UnsupportedModelError
from .attention import DEFAULT_ATTENTION, STATE_KWARG, ChunkAttention, KVBuffer
from .carried_state import StateCarry, carried_layer_backward
from .config import StreamConfig
from .layer_backward import layer_backward
from .layout import SequenceLayout, chunk_bounds, chunk_kwargs
from .objectives.router_loss import RouterBalance
from .placements.placement import CheckpointStore, Placement


class LayerPasses(Protocol):
    """One decoder layer's two passes over its chunks. `forward`: X_{l+1} into sink from X_l read
    from source, no graph (the checkpoint pass and the rebuilds). `backward`: dZ (B, T, d) in `grad`
    becomes dX when need_input_grad, the layer's parameter gradients left in .grad. call: what runs
    a chunk, `layer` itself unless a data-parallel engine needs its hook-free forward (grad_sync.py).
    ChunkedPasses when one process holds the sequence; parallel/sequence_layer.py's
    SequenceParallelStep when ranks share it."""

    def forward(self, index: int, layer: nn.Module, call, source, sink, kwargs: dict) -> None: ...

    def backward(
        self, index: int, layer: nn.Module, call, layer_input, grad, kwargs: dict, *, need_input_grad: bool
    ) -> None: ...


@dataclass
class ChunkedPasses:
    """The layer passes when one process holds the whole sequence: chunked_layer_forward, then
    layer_backward for a layer that attends, carried_layer_backward for one that carries a state or
    mixes nothing (what its forward showed). layout: the batch's padding and packed documents
    (layout.py); router: a mixture-of-experts model's load-balancing term (objectives/router_loss.py)."""

    config: StreamConfig
    attention: ChunkAttention = DEFAULT_ATTENTION
    layout: SequenceLayout | None = None
    router: RouterBalance | None = None
    attends: dict[int, bool] = field(default_factory=dict)  # per layer, from its forward

    def forward(self, index: int, layer: nn.Module, call, source, sink, kwargs: dict) -> None:
        self.attends[index] = chunked_layer_forward(
            layer, call, source, sink, kwargs, self.config.chunk_size, self.layout, self.attention
        )

    def backward(
        self, index: int, layer: nn.Module, call, layer_input, grad, kwargs: dict, *, need_input_grad: bool
    ) -> None:
        backward = layer_backward if self.attends.get(index, True) else carried_layer_backward
        backward(
            layer, layer_input, grad, kwargs, config=self.config, attention=self.attention,
            need_input_grad=need_input_grad, call=call, layout=self.layout, router=self.router,
        )  # fmt: skip


@dataclass
class Checkpoints:
    layer_inputs: CheckpointStore  # X_l, (B, T, d) each, where the placement keeps them (or a StreamingStore)
    passes: LayerPasses  # how each layer runs over its chunks
    layer_kwargs: list[dict] = field(default_factory=list)
    last_hidden: torch.Tensor | None = None  # last layer output, input of the final norm
    seen: set[int] = field(default_factory=set)  # layers the forward called


def forward_checkpoints(
    parts: DecoderParts,
    input_ids: torch.Tensor,
    passes: LayerPasses,
    store: CheckpointStore | None = None,
    gathered: Callable[[nn.Module], AbstractContextManager] | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    prepare_embedding: Callable[[], None] = lambda: None,
) -> Checkpoints:
    """passes: how each layer runs over its chunks (LayerPasses). store: where the layer inputs go
    (default: all kept on their device, the gpu placement). gathered(layer): a context that holds
    the layer's parameters gathered while its chunks run (a sharded engine whose hooks would
    otherwise gather per chunk: DeepSpeed ZeRO-3; grad_sync.py). position_ids: (B or 1, T), given to
    the decoder (packed rows); None: its own, arange(T). prepare_embedding: before the embedding
    runs outside the decoder's call (the stream placement computes X_0 chunk by chunk where it
    reads it; a sharded engine gathers the embedding)."""
    num_layers = len(parts.layers)
    store = store if store is not None else CheckpointStore(Placement(), num_layers)
    gathered = gathered if gathered is not None else _nothing_to_gather
    saved = Checkpoints(layer_inputs=store, passes=passes, layer_kwargs=[{}] * num_layers)

    norm_calls = []

    def norm_hook(module, args):
        saved.last_hidden = args[0]
        norm_calls.append(1)

    # first of the norm's pre-hooks: Z_L as the last layer gave it; the head runs the norm with its hooks
    handle = parts.norm.register_forward_pre_hook(norm_hook, prepend=True)
    try:
        with (
            store.passing(parts, input_ids, prepare_embedding),
            _chunked_layers(parts.layers, saved, gathered),
            _skipped(parts.norm),
            torch.no_grad(),
        ):
            # no attention_mask: the layout says which keys each query sees (the normed output is unused)
            parts.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    finally:
        handle.remove()
    if len(norm_calls) > 1:  # the pass skipped it each time: only the norm after the last layer is the head's
        raise UnsupportedModelError(
            f"the decoder's final norm runs {len(norm_calls)} times in its forward (also before or between the "
            "layers); StreamBP runs it once, after the last layer"
        )
    if saved.last_hidden is None or len(saved.seen) != num_layers:
        raise RuntimeError("the model's forward did not call every decoder layer and the final norm")
    return saved


def _nothing_to_gather(layer: nn.Module) -> AbstractContextManager:
    return nullcontext()


@contextmanager
def _skipped(norm: nn.Module):
    """The decoder's final norm returns its input for the duration of the pass (its pre-hook has
    kept Z_L; the head applies the norm chunk by chunk). Run on the whole sequence, transformers'
    RMSNorm would upcast it, briefly holding two fp32 (B, T, d) tensors: 8 x d bytes per token, more
    than four bf16 checkpoints."""
    previous = norm.__dict__.get("forward")
    norm.forward = lambda hidden_states, *args, **kwargs: hidden_states
    try:
        yield
    finally:
        if previous is None:
            del norm.forward
        else:
            norm.forward = previous


@contextmanager
def _chunked_layers(layers: nn.ModuleList, saved: Checkpoints, gathered):
    """Each layer's forward runs chunk by chunk for the duration (`forwards_wrapped`). The input
    each layer is called with is recorded before any pre-hook of the caller's runs: the layer
    backward and the rebuilds call the layer with its hooks on that input, so a pre-hook that
    changes the input (a steering vector) acts once, as in the model's own forward."""
    called_with: dict[int, torch.Tensor] = {}

    def record(index: int):
        def hook(module, args):
            called_with[index] = args[0] if args else None

        return hook

    def chunked(index: int, forward):
        layer = layers[index]
        return _chunked_forward(layer, forward, index, saved, partial(gathered, layer), called_with)

    handles = [layer.register_forward_pre_hook(record(index), prepend=True) for index, layer in enumerate(layers)]
    try:
        with forwards_wrapped(layers, chunked):
            yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def forwards_wrapped(layers, wrap: Callable[[int, Callable], Callable]):
    """Each layer's forward replaced by wrap(index, forward) on the instance for the duration (hooks
    and __call__ still run as usual); whatever was there before (a plain method, or another
    library's wrapper) restored, whatever happens."""
    previous = [layer.__dict__.get("forward") for layer in layers]
    for index, layer in enumerate(layers):
        layer.forward = wrap(index, layer.forward)
    try:
        yield
    finally:
        for layer, forward in zip(layers, previous):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


def _chunked_forward(layer: nn.Module, forward, index: int, saved: Checkpoints, gathered, called_with: dict):
    def chunked(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args:
            raise NotImplementedError("StreamBP expects decoder layers called as layer(hidden_states, **kwargs)")
        saved.layer_kwargs[index] = kwargs
        saved.seen.add(index)

        def run(source, sink) -> None:
            saved.passes.forward(index, layer, forward, source, sink, kwargs)

        with gathered():  # X_l kept as the layer was called with it; its chunks run on what its pre-hooks made
            return saved.layer_inputs.forward_layer(index, hidden_states, run, kept=called_with.pop(index, None))

    return chunked


def chunked_layer_forward(
    layer: nn.Module,
    forward,
    source,
    sink,
    kwargs: dict,
    chunk_size: int,
    layout: SequenceLayout | None = None,
    attention: ChunkAttention = DEFAULT_ATTENTION,
) -> bool:
    """X_{l+1} into sink from X_l (B, T, d) read from source (sequences.py), chunk_size positions at
    a time through `forward` (the layer, its forward method or its hook-free call), attending over a
    key/value buffer of the positions before, or carrying its mixer's state from chunk to chunk
    (carried_state.py). The checkpoint pass and the recompute placements (placement.py,
    stream_store.py) both run it, so a rebuilt input is the one the pass made. Each input chunk is
    read before its output chunk is written, so source and sink may be one host buffer. Call it
    without grad. Returns whether the layer attends (one attention call per chunk) rather than
    carrying a state or mixing nothing."""
    seq_len = source.shape[1]
    buffer = KVBuffer(seq_len=seq_len, attend=True, layout=layout, attention=attention)
    carry = StateCarry() if carries_state(layer) else None
    if carry is not None and layout is not None:
        raise UnsupportedModelError(
            f"{type(layer).__name__} carries a state across positions: left padding and packed rows are not supported "
            "with it; pad on the right"
        )
    extra = {} if carry is None else {"cache": carry}
    bounds = chunk_bounds(seq_len, chunk_size)
    for (start, end), hidden in zip(bounds, source.chunks(bounds)):
        buffer.start, buffer.calls = start, 0
        if carry is not None:
            carry.updates = 0
        chunk = forward(hidden, **{**chunk_kwargs(kwargs, start, end), **extra}, **{STATE_KWARG: buffer})
        _check_mixing(layer, buffer.calls, 0 if carry is None else carry.updates)
        if not isinstance(chunk, torch.Tensor):
            raise UnsupportedModelError(
                f"{type(layer).__name__} returns a {type(chunk).__name__}, not its hidden states: StreamBP streams "
                "decoder layers that return one tensor, as transformers' current layers do"
            )
        sink.write(start, end, chunk)
    return buffer.calls == 1


def _check_mixing(layer: nn.Module, attention_calls: int, state_updates: int) -> None:
    """One chunk mixes positions through one attention call, or through a carried state, or not at
    all; anything else would go unstreamed: refused."""
    name = type(layer).__name__
    if attention_calls > 1 or (attention_calls and state_updates):
        raise UnsupportedModelError(
            f"{name} called its attention function {attention_calls} times on one chunk"
            + (" beside a state-carrying mixer" if state_updates else "")
            + "; StreamBP streams layers with one attention call, or one carried state, each"
        )
    if not attention_calls and not state_updates:
        convolution = next((m for m in layer.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
        if convolution is not None:
            raise UnsupportedModelError(
                f"{name} has a {type(convolution).__name__} that mixes neighbouring positions without handing its "
                "state to transformers' cache, so StreamBP cannot carry it across chunks"
            )
