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
(chunking.chunk_kwargs). core/README.md, "Checkpoint pass".
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from .adapters import DecoderParts
from .attention import DEFAULT_ATTENTION, STATE_KWARG, ChunkAttention, KVBuffer
from .chunking import chunk_bounds, chunk_kwargs
from .layout import SequenceLayout
from .placements.placement import CheckpointStore, Placement


@dataclass
class Checkpoints:
    layer_inputs: CheckpointStore  # X_l, (B, T, d) each, where the placement keeps them (or a StreamingStore)
    layer_kwargs: list[dict] = field(default_factory=list)
    last_hidden: torch.Tensor | None = None  # last layer output, input of the final norm
    seen: set[int] = field(default_factory=set)  # layers the forward called
    layout: SequenceLayout | None = None  # padding and packed documents (layout.py)
    attention: ChunkAttention = DEFAULT_ATTENTION  # the step's chunk-attention kernel and hooks
    layer_forward: Callable = None  # how a layer runs over its chunks: chunked_layer_forward, or sequence parallel's


def forward_checkpoints(
    parts: DecoderParts,
    input_ids: torch.Tensor,
    chunk_size: int,
    store: CheckpointStore | None = None,
    gathered: Callable[[nn.Module], AbstractContextManager] | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    layout: SequenceLayout | None = None,
    prepare_embedding: Callable[[], None] = lambda: None,
    attention: ChunkAttention = DEFAULT_ATTENTION,
    layer_forward: Callable | None = None,
) -> Checkpoints:
    """store: where the layer inputs go (default: all kept on their device, the gpu placement).
    gathered(layer): a context that holds the layer's parameters gathered while its chunks run (a
    sharded engine whose hooks would otherwise gather per chunk: DeepSpeed ZeRO-3; grad_sync.py).
    position_ids: (B or 1, T), given to the decoder (packed rows); None: its own, arange(T).
    layout: the batch's padding and packed documents (layout.py), None for one sequence per row.
    prepare_embedding: before the embedding runs outside the decoder's call (the stream placement
    computes X_0 chunk by chunk where it reads it; a sharded engine gathers the embedding).
    attention: the chunks' kernel setting and the step's hooks (attention.py). layer_forward: what
    runs a layer over its chunks, `chunked_layer_forward` unless the sequence is split over ranks
    (parallel/sequence_layer.py)."""
    num_layers = len(parts.layers)
    store = store if store is not None else CheckpointStore(Placement(), num_layers)
    gathered = gathered if gathered is not None else _nothing_to_gather
    saved = Checkpoints(
        layer_inputs=store, layer_kwargs=[{}] * num_layers, layout=layout, attention=attention,
        layer_forward=layer_forward or chunked_layer_forward,
    )  # fmt: skip

    def norm_hook(module, args):
        saved.last_hidden = args[0]

    handle = parts.norm.register_forward_pre_hook(norm_hook)
    try:
        with (
            store.passing(parts, input_ids, prepare_embedding),
            _chunked_layers(parts.layers, saved, chunk_size, gathered),
            _skipped(parts.norm),
            torch.no_grad(),
        ):
            # no attention_mask: the layout says which keys each query sees (the normed output is unused)
            parts.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    finally:
        handle.remove()
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
def _chunked_layers(layers: nn.ModuleList, saved: Checkpoints, chunk_size: int, gathered):
    """Each layer's forward runs chunk by chunk for the duration (`forwards_wrapped`)."""

    def chunked(index: int, forward):
        return _chunked_forward(forward, index, saved, chunk_size, partial(gathered, layers[index]))

    with forwards_wrapped(layers, chunked):
        yield


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


def _chunked_forward(forward, index: int, saved: Checkpoints, chunk_size: int, gathered):
    def chunked(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args:
            raise NotImplementedError("StreamBP expects decoder layers called as layer(hidden_states, **kwargs)")
        saved.layer_kwargs[index] = kwargs
        saved.seen.add(index)

        def run(source, sink) -> None:
            saved.layer_forward(forward, source, sink, kwargs, chunk_size, saved.layout, saved.attention)

        with gathered():
            return saved.layer_inputs.forward_layer(index, hidden_states, run)

    return chunked


def chunked_layer_forward(
    forward,
    source,
    sink,
    kwargs: dict,
    chunk_size: int,
    layout: SequenceLayout | None = None,
    attention: ChunkAttention = DEFAULT_ATTENTION,
) -> None:
    """X_{l+1} into sink from X_l (B, T, d) read from source (sequences.py), chunk_size positions at
    a time through `forward` (a layer or its forward method), attending over a key/value buffer of
    the positions before. The checkpoint pass and the recompute placements (placement.py,
    stream_store.py) both run it, so a rebuilt input is the one the pass made. Each input chunk is
    read before its output chunk is written, so source and sink may be one host buffer. Call it
    without grad."""
    seq_len = source.shape[1]
    buffer = KVBuffer(seq_len=seq_len, attend=True, layout=layout, attention=attention)
    bounds = chunk_bounds(seq_len, chunk_size)
    for (start, end), hidden in zip(bounds, source.chunks(bounds)):
        buffer.start = start
        chunk = forward(hidden, **chunk_kwargs(kwargs, start, end), **{STATE_KWARG: buffer})
        sink.write(start, end, chunk)
