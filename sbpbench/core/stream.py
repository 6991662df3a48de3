"""`stream_backward`: exact StreamBP for a training objective (SFT, GRPO, DPO: objectives.py) on an
unmodified HuggingFace causal LM (or a PEFT LoRA wrapper of one).

Order of work (B batch, T sequence, d hidden, L layers, V vocabulary):
  checkpoint pass   the model's forward without a graph, each layer in chunks of chunk_size;
                    keeps X_0..X_{L-1} and Z_L                                         (L+1) x B x T x d
  head              final norm + lm_head + loss in chunks of logits_chunk_size -> dZ_L  B x c x V at a time
                    (DPO: a no-grad pass for the sequence sums first)
  layers L-1..0     layer_backward in chunks of chunk_size; dZ becomes dX in place      one B x T x d buffer
  embedding         embed(input_ids[chunk]).backward(dX_0[chunk]) in chunks of chunk_size
Each checkpoint is dropped as soon as its layer's backward is done. core/README.md follows this
order section by section; "Memory per phase" gives what is resident when.
"""

from __future__ import annotations

from contextlib import closing, contextmanager, nullcontext

import torch

from .adapters import DecoderParts, check_no_attention_dropout, resolve_parts, trainable
from .attention import ATTENTION_NAME, ChunkAttention
from .checkpoints import Checkpoints, forward_checkpoints
from .chunking import chunk_bounds
from .config import StreamConfig
from .grad_accum import ChunkGradAccumulator
from .head import head_backward
from .hooks import NO_HOOKS, StepHooks
from .kernels.kernel_choice import check_chunk_attention
from .layer_backward import layer_backward
from .layout import build_layout
from .objectives import SFT, Objective
from .parallel.grad_sync import for_model as grad_sync_for
from .parallel.grad_sync import unwrap
from .parallel.grad_sync_base import GradSync
from .parallel.sequence_group import SequenceParallel
from .parallel.sequence_step import local_batch, reduce_loss, summed_gradients
from .phases import CHECKPOINT_PASS, HEAD, REBUILD, timed
from .placements.placement import CheckpointStore
from .placements.stream_store import StreamingStore

DEFAULT_CONFIG = StreamConfig()


def stream_backward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    objective: Objective | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    config: StreamConfig = DEFAULT_CONFIG,
    hooks: StepHooks | None = None,
    scale_wrt_gas: bool = True,
    sequence_parallel: SequenceParallel | None = None,
) -> torch.Tensor:
    """Forward + backward of a training objective with StreamBP. Returns the loss (0-dim, detached)
    and accumulates into every trainable parameter's .grad what
    `objective.full_loss(model(input_ids=..., attention_mask=...).logits).backward()` would, to
    rounding; for SFT that is `model(..., labels=labels).loss.backward()`.

    model: a causal LM, one wrapped with FSDP2, or a DeepSpeedEngine (ZeRO 0-3: called in place of
    `engine.backward(loss)`, before `engine.step()`). input_ids: (B, T) int64. Either labels ((B, T),
    -100 where not counted, shifted inside: the SFT objective) or an `objective` (objectives/: SFT,
    GRPO, DPO). attention_mask: (B, T) 0/1, left or right padding; position_ids: (B or 1, T), packed
    documents restarting at 0 (layout.py says what each gives). config: StreamBP's knobs (config.py);
    hooks: what the caller watches of the step (hooks.py). scale_wrt_gas: a DeepSpeedEngine's, as
    `engine.backward(loss, scale_wrt_gas=...)`: False leaves the gradients undivided by its
    gradient_accumulation_steps (transformers' Trainer scales its loss itself). sequence_parallel:
    the group of ranks sharing each sequence (parallel/sequence_group.py), each given the same whole
    batch; the loss returned is the whole sequence's on every rank."""
    hooks = hooks if hooks is not None else NO_HOOKS
    check_chunk_attention(config.chunk_attention, input_ids.device, hooks.chooser)
    if (labels is None) == (objective is None):
        raise ValueError("give either labels (the SFT objective) or objective=..., not both or neither")
    objective = objective if objective is not None else SFT(labels)
    _check_shapes(input_ids, objective.labels)
    layout = build_layout(attention_mask, position_ids, objective.mask, packing_refused=objective.packing_refused)
    parts = resolve_parts(unwrap(model))  # a DeepSpeedEngine: its module
    check_no_attention_dropout(parts)
    sync = grad_sync_for(model, parts, sequence_parallel=sequence_parallel is not None)  # FSDP2, DeepSpeed or none
    layer_passes = None  # one process holds the whole sequence: checkpoints.py and layer_backward.py
    if sequence_parallel is not None:  # this rank's positions, ids, objective and layer passes
        local = local_batch(
            sequence_parallel, parts, input_ids, objective, chunk_size=config.chunk_size,
            logits_chunk_size=config.logits_chunk_size, sync=sync, attention_mask=attention_mask,
            position_ids=position_ids,
        )  # fmt: skip
        input_ids, position_ids, objective, layer_passes, layout = (
            local.input_ids,
            local.position_ids,
            local.objective,
            local.step,
            None,
        )
    if scale_wrt_gas:
        objective = sync.objective(objective)  # DeepSpeed: each chunk's gradient / accumulation steps
    if hooks.timer is not None:
        hooks.timer.start(input_ids.device)
    store = _store(config, len(parts.layers), hooks)
    attention = ChunkAttention(config.chunk_attention, hooks)
    summed = (
        nullcontext()
        if sequence_parallel is None
        else summed_gradients(sequence_parallel, trainable(parts.model), sync)
    )
    with summed, _streaming_mode(parts), sync.step(), closing(store):  # close: frees what an error left
        with hooks.timed(CHECKPOINT_PASS):
            saved = forward_checkpoints(
                parts, input_ids, config.chunk_size, store, gathered=sync.gathered, position_ids=position_ids,
                layout=layout, prepare_embedding=sync.gather_head, attention=attention,
                layer_forward=layer_passes.layer_forward if layer_passes else None,
            )  # fmt: skip
        store.rebuild_into = lambda index, source, sink: _rebuild(parts, saved, index, source, sink, config, sync)
        loss, grad, head_grads = _head(parts, saved, store, objective, config, hooks, sync)
        backward = layer_passes.layer_backward if layer_passes else layer_backward
        _layers_backward(parts, saved, store, grad, config, attention, sync, backward)
        if trainable(parts.embed):
            sync.gather_head()
            embedding_grads = ChunkGradAccumulator(trainable(parts.embed), config.fp32_grad_accumulation, hooks.kinds)
            _embedding_backward(sync.head(parts.embed), input_ids, grad, config.chunk_size, embedding_grads)
        head_grads.finish()  # no-op unless tied
    if hooks.timer is not None:
        hooks.timer.finish()
    return loss if sequence_parallel is None else reduce_loss(sequence_parallel, loss, objective)


def _store(config: StreamConfig, num_layers: int, hooks: StepHooks) -> CheckpointStore:
    """Where the step keeps its layer inputs (placements/), told to the hooks' on_store."""
    placement = config.checkpoints
    kind = StreamingStore if placement.stream else CheckpointStore
    store = kind(placement, num_layers, kinds=hooks.kinds, shapes_only=hooks.shapes_only)
    store.timer = hooks.timer
    if hooks.on_store is not None:
        hooks.on_store(store)
    return store


def _head(parts: DecoderParts, saved: Checkpoints, store, objective, config: StreamConfig, hooks, sync: GradSync):
    """The head phase: the loss and dZ_L (B, T, d), which becomes dX layer after layer; the norm's
    and lm_head's gradient sums, finished unless the lm_head is tied to a trainable embedding."""
    with hooks.timed(HEAD):
        sync.gather_head()  # a head unit of its own that the checkpoint pass resharded
        head_params = trainable(parts.norm) + trainable(parts.lm_head)
        head_grads = ChunkGradAccumulator(head_params, config.fp32_grad_accumulation, hooks.kinds)
        last_hidden = store.last_hidden(saved.last_hidden)
        saved.last_hidden = None
        grad = store.head_grad(last_hidden)  # dZ_L
        loss = head_backward(
            parts, last_hidden, grad, objective, chunk_size=config.logits_chunk_size, accumulator=head_grads,
            call=sync.head, kinds=hooks.kinds,
        )  # fmt: skip
        del last_hidden  # Z_L (on the device unless streamed)
        if trainable(parts.embed) and parts.lm_head.weight is parts.embed.weight:
            head_grads.round_sums()  # the embedding's gradient joins this sum before it meets .grad
        else:
            head_grads.finish()
    return loss, grad, head_grads


def _layers_backward(
    parts: DecoderParts, saved: Checkpoints, store, grad, config, attention, sync: GradSync, backward=layer_backward
) -> None:
    """Layers L-1 down to 0: each layer's chunked backward, its gradient reduced once, X_l freed."""
    progress, num_layers = attention.hooks.progress, len(parts.layers)
    embed_trainable = bool(trainable(parts.embed))
    if progress is not None:
        progress(0, num_layers)
    for index in reversed(range(num_layers)):
        layer = parts.layers[index]
        sync.begin(layer)
        backward(
            layer, store.get(index, grad.device), grad, saved.layer_kwargs[index], config=config, attention=attention,
            need_input_grad=embed_trainable or index > 0, call=sync.call(layer), layout=saved.layout,
            key_values=parts.key_values,
        )  # fmt: skip
        sync.end(layer)  # the chunks' summed gradients, reduced once
        store.release(index)  # free X_l
        if progress is not None:
            progress(num_layers - index, num_layers)


def _embedding_backward(embed, input_ids: torch.Tensor, grad, chunk_size: int, accumulator) -> None:
    """The embedding's weight gradient from dX_0 (B, T, d; sequences.py), chunk_size positions at a
    time: neither the embedding's output nor dX_0 is ever whole on the device. Each chunk's gradient
    is summed by `accumulator` (fp32 for bf16/fp16 weights, grad_accum.py), as a layer's are; with
    tied weights the sum joins the head's rounded sum when the head's accumulator finishes."""
    bounds = chunk_bounds(input_ids.shape[1], chunk_size)
    grads = grad.chunks(bounds)
    for start, end in bounds:
        with torch.enable_grad():
            output = embed(input_ids[:, start:end])
        output.backward(next(grads))
        accumulator.collect()
    accumulator.finish()


def _rebuild(
    parts: DecoderParts, saved: Checkpoints, index: int, source, sink, config: StreamConfig, sync: GradSync
) -> None:
    """X_{index+1} into sink from X_index read from source, as the checkpoint pass made it (recompute
    placements; sequences.py). A sharded layer is gathered once for the whole rebuild, and its chunks
    run hook-free (grad_sync.py)."""
    layer = parts.layers[index]
    with timed(saved.layer_inputs.timer, REBUILD), torch.no_grad(), sync.rebuilding(layer):
        saved.layer_forward(
            sync.call(layer), source, sink, saved.layer_kwargs[index], config.chunk_size, saved.layout,
            saved.attention,
        )  # fmt: skip


def _check_shapes(input_ids, labels) -> None:
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and labels must both be (batch, seq_len); got {tuple(input_ids.shape)} and {tuple(labels.shape)}"
        )


@contextmanager
def _streaming_mode(parts: DecoderParts):
    """Switch the model to the StreamBP attention function and plain (non-checkpointed) layers
    for the duration of the step; restore both exactly, whatever happens."""
    config = parts.config
    previous_attention = config._attn_implementation
    checkpointed = [layer for layer in parts.layers if getattr(layer, "gradient_checkpointing", False)]
    config._attn_implementation = ATTENTION_NAME
    for layer in checkpointed:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        config._attn_implementation = previous_attention
        for layer in checkpointed:
            layer.gradient_checkpointing = True
