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

from collections.abc import Callable
from contextlib import closing, contextmanager

import torch

from .adapters import DecoderParts, check_no_attention_dropout, resolve_parts, trainable
from .attention import ATTENTION_NAME
from .checkpoints import Checkpoints, chunked_layer_forward, forward_checkpoints
from .chunking import chunk_bounds
from .grad_accum import ChunkGradAccumulator
from .head import head_backward
from .kernels.kernel_choice import check_chunk_attention
from .kernels.kernel_choice import chunk_attention as use_chunk_attention
from .layer_backward import layer_backward
from .layout import build_layout
from .objectives import SFT, Objective
from .parallel.grad_sync import for_model as grad_sync_for
from .parallel.grad_sync import unwrap
from .parallel.grad_sync_base import GradSync
from .phases import CHECKPOINT_PASS, HEAD, REBUILD, PhaseTimer, timed
from .placements.placement import CheckpointStore, Placement
from .placements.stream_store import StreamingStore

DEFAULT_CHUNK_SIZE = 500  # the paper's layer partition for its max-length runs (appendix D)
DEFAULT_LOGITS_CHUNK_SIZE = 100  # the paper's logits partition

# progress(done, num_layers): called with 0 once the checkpoint pass and the head are done, then
# after each layer's backward with the number of layers done. Core only calls it; what to do with
# it (print past a few seconds, log) is the caller's.
LayerProgress = Callable[[int, int], None]


def stream_backward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    objective: Objective | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    logits_chunk_size: int = DEFAULT_LOGITS_CHUNK_SIZE,
    fp32_grad_accumulation: bool = True,
    checkpoints: str | Placement = "gpu",
    progress: LayerProgress | None = None,
    scale_wrt_gas: bool = True,
    timer: PhaseTimer | None = None,
    chunk_attention: str = "auto",
) -> torch.Tensor:
    """Forward + backward of a training objective with StreamBP.

    model: a causal LM, one wrapped with FSDP2, or a DeepSpeedEngine (ZeRO 0-3; then in place of
    `engine.backward(loss)`, gradients divided by its gradient_accumulation_steps, before `engine.step()`).

    Returns the loss (0-dim, detached) and accumulates into every trainable parameter's .grad what
    `objective.full_loss(model(input_ids=..., attention_mask=...).logits).backward()` would, to
    rounding; for SFT that is `model(..., labels=labels).loss.backward()`.

    input_ids: (B, T) int64. Give either labels ((B, T), -100 where not counted, HF convention,
    shifted inside: the SFT objective) or an `objective` (objectives.SFT / GRPO / DPO, which hold
    their own labels and inputs). attention_mask: (B, T) of 0/1, each row 0...0 1...1 0...0 (left
    padding, as TRL's GRPO batches, right padding, or both), as the model takes it: pads are never
    keys of a real query, positions are arange(T) pads included; padded positions must not be the
    source of a counted prediction. position_ids: (B or 1, T), packed documents: 0, 1, ... restarting
    at 0 for each document (TRL's padding-free rows); each document gets the gradients of BP run on
    it alone, and the first label of each document must be -100 (SFT only). See layout.py.
    chunk_size: positions per chunk in the layer backward; logits_chunk_size: positions per chunk
    in the head. fp32_grad_accumulation: sum per-chunk
    gradients of bf16/fp16 parameters in fp32 and round once (see grad_accum.py). checkpoints:
    where the layer inputs live between the checkpoint pass and their layer's backward, "gpu"
    (the model's device), "cpu", "recompute:K", "cpu+recompute:K", "cpu+recompute:K+spill", or
    "stream" / "stream:N" (the inputs, Z_L and the gradient in host memory, moved a chunk at a time;
    placement.py, stream_store.py); the same
    operations whatever the placement, so the same gradients. On CUDA an offloading placement's host
    copies live in page-locked buffers that the process keeps for later steps (registering them is
    slow); `release_pinned_memory()` frees them (host_pool.py says what is kept when T changes).
    progress: see LayerProgress (per layer of the backward, for long steps). scale_wrt_gas: a
    DeepSpeedEngine only, as `engine.backward(loss, scale_wrt_gas=...)`: False leaves the gradients
    undivided by the engine's gradient_accumulation_steps (transformers' Trainer: its loss is already
    scaled for accumulation). timer: a PhaseTimer (phases.py) that times each phase of this step,
    summed over layers; `timer.resolve()` after the step reads it (on CUDA: one synchronize, then).
    chunk_attention: the kernel for a chunk's attention over its prefix, "auto" (on a GPU the fastest,
    measured on first use of a shape; elsewhere "lower-right"), "lower-right" (SDPA with a lower-right
    causal bias), "split", "flex", "fa3" or "fa4" (chunk_kernels.py, kernel_choice.py); each gives the
    same gradients to rounding.
    """
    _check_sizes(chunk_size, logits_chunk_size)
    check_chunk_attention(chunk_attention, input_ids.device)
    placement = checkpoints if isinstance(checkpoints, Placement) else Placement.parse(checkpoints)
    if (labels is None) == (objective is None):
        raise ValueError("give either labels (the SFT objective) or objective=..., not both or neither")
    objective = objective if objective is not None else SFT(labels)
    _check_shapes(input_ids, objective.labels)
    layout = build_layout(attention_mask, position_ids, objective.mask, packing_refused=objective.packing_refused)
    parts = resolve_parts(unwrap(model))  # a DeepSpeedEngine: its module
    check_no_attention_dropout(parts)
    sync = grad_sync_for(model, parts)  # FSDP2, DeepSpeed or one process; refuses sequence parallelism
    if scale_wrt_gas:
        objective = sync.objective(objective)  # DeepSpeed: each chunk's gradient / accumulation steps

    if timer is not None:
        timer.start(input_ids.device)
    store = (StreamingStore if placement.stream else CheckpointStore)(placement, len(parts.layers))
    store.timer = timer
    kernels = use_chunk_attention(chunk_attention)
    with _streaming_mode(parts), sync.step(), closing(store), kernels:  # close: frees (and unpins) what an error left
        with timed(timer, CHECKPOINT_PASS):
            saved = forward_checkpoints(
                parts, input_ids, chunk_size, store, gathered=sync.gathered, position_ids=position_ids, layout=layout,
                prepare_embedding=sync.gather_head,
            )  # fmt: skip
        store.rebuild_into = lambda index, source, sink: _rebuild(parts, saved, index, source, sink, chunk_size, sync)
        embed_trainable = bool(trainable(parts.embed))
        with timed(timer, HEAD):
            sync.gather_head()  # a head unit of its own that the checkpoint pass resharded
            head_grads = ChunkGradAccumulator(trainable(parts.norm) + trainable(parts.lm_head), fp32_grad_accumulation)
            last_hidden = store.last_hidden(saved.last_hidden)
            saved.last_hidden = None
            grad = store.head_grad(last_hidden)  # dZ_L; becomes dX layer after layer
            loss = head_backward(
                parts, last_hidden, grad, objective, chunk_size=logits_chunk_size, accumulator=head_grads,
                call=sync.head,
            )  # fmt: skip
            del last_hidden  # Z_L (on the device unless streamed)
            tied = embed_trainable and parts.lm_head.weight is parts.embed.weight
            if tied:
                head_grads.round_sums()  # the embedding's gradient joins this sum before it meets .grad
            else:
                head_grads.finish()
        num_layers = len(parts.layers)
        if progress is not None:
            progress(0, num_layers)
        for index in reversed(range(num_layers)):
            sync.begin(parts.layers[index])
            layer_backward(
                parts.layers[index],
                store.get(index, grad.device),
                grad,
                saved.layer_kwargs[index],
                chunk_size=chunk_size,
                need_input_grad=embed_trainable or index > 0,
                fp32_grad_accumulation=fp32_grad_accumulation,
                call=sync.call(parts.layers[index]),
                layout=layout,
                key_values=parts.key_values,
                timer=timer,
            )
            sync.end(parts.layers[index])  # the chunks' summed gradients, reduced once
            store.release(index)  # free X_l
            if progress is not None:
                progress(num_layers - index, num_layers)
        if embed_trainable:
            sync.gather_head()
            embedding_grads = ChunkGradAccumulator(trainable(parts.embed), fp32_grad_accumulation)
            _embedding_backward(sync.head(parts.embed), input_ids, grad, chunk_size, embedding_grads)
        head_grads.finish()  # no-op unless tied
    if timer is not None:
        timer.finish()
    return loss


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
    parts: DecoderParts, saved: Checkpoints, index: int, source, sink, chunk_size: int, sync: GradSync
) -> None:
    """X_{index+1} into sink from X_index read from source, as the checkpoint pass made it (recompute
    placements; sequences.py). A sharded layer is gathered once for the whole rebuild, and its chunks
    run hook-free (grad_sync.py)."""
    layer = parts.layers[index]
    with timed(saved.layer_inputs.timer, REBUILD), torch.no_grad(), sync.rebuilding(layer):
        chunked_layer_forward(sync.call(layer), source, sink, saved.layer_kwargs[index], chunk_size, saved.layout)


def _check_sizes(chunk_size: int, logits_chunk_size: int) -> None:
    for name, value in (("chunk_size", chunk_size), ("logits_chunk_size", logits_chunk_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


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
