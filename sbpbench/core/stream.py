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

from .architecture.admission import admit, verdict
from .architecture.detectors import carries_state, check_hooks_run, check_streamable
from .architecture.parts import DecoderParts, UnsupportedModelError, resolve_parts, trainable
from .architecture.self_check import refuse_unless_exact
from .attention import ATTENTION_NAME, ChunkAttention
from .checkpoints import Checkpoints, ChunkedPasses, forward_checkpoints
from .config import StreamConfig
from .grad_accum import ChunkGradAccumulator
from .head import head_backward
from .hooks import NO_HOOKS, StepHooks, steered
from .kernels.kernel_choice import LOWER_RIGHT, check_chunk_attention
from .layout import build_layout, chunk_bounds
from .objectives import SFT, Objective
from .objectives.router_loss import RouterBalance
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
    router_aux_loss_coef: float | None = None,
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
    batch; the loss returned is the whole sequence's on every rank. router_aux_loss_coef: a
    mixture-of-experts model's load-balancing loss (objectives/router_loss.py) added to the
    objective with this coefficient; None: as the model's forward adds it (its config's
    output_router_logits and router_aux_loss_coef), 0: not at all.

    The model must stream exactly: the detectors and the self-check of its architecture
    (architecture/admission.py) refuse it otherwise, with an UnsupportedModelError, before any work."""
    return _stream_backward(
        model, input_ids, labels, objective=objective, attention_mask=attention_mask, position_ids=position_ids,
        config=config, hooks=hooks, scale_wrt_gas=scale_wrt_gas, sequence_parallel=sequence_parallel,
        router_aux_loss_coef=router_aux_loss_coef, admitted=False,
    )  # fmt: skip


def check_model(model: torch.nn.Module | None = None, *, model_class: type | None = None, config=None):
    """Whether `model` (or the architecture `model_class` built from `config`) streams exactly: an
    UnsupportedModelError naming the reason if not. Returns the self-check's verdict (SelfCheck), or
    None for an architecture in the verified table. Runs the self-check once per architecture and
    process, as the first step would (architecture/admission.py)."""
    if model is None:
        if model_class is None or config is None:
            raise TypeError("check_model needs a model, or model_class= and config=")
        with torch.device("meta"):
            model = model_class._from_config(config)
    parts = resolve_parts(unwrap(model))
    check_streamable(parts)
    check = verdict(type(parts.model), parts.config, _self_check_step, training=parts.model.training)
    if check is not None:
        refuse_unless_exact(check)
    return check


def _self_check_step(model, input_ids, labels, attention_mask, chunk_size: int, logits_chunk_size: int):
    """The step the self-check compares with standard BP, on its small copy (admitted already)."""
    # the reference kernel: the check is of the architecture, and a kernel chosen elsewhere (a
    # compiled one) cannot run under the check's float64 dispatch mode
    config = StreamConfig(chunk_size=chunk_size, logits_chunk_size=logits_chunk_size, chunk_attention=LOWER_RIGHT)
    return _stream_backward(model, input_ids, labels, attention_mask=attention_mask, config=config, admitted=True)


def _stream_backward(
    model, input_ids, labels=None, *, objective=None, attention_mask=None, position_ids=None,
    config: StreamConfig = DEFAULT_CONFIG, hooks: StepHooks | None = None, scale_wrt_gas: bool = True,
    sequence_parallel: SequenceParallel | None = None, router_aux_loss_coef: float | None = None, admitted: bool,
) -> torch.Tensor:  # fmt: skip
    _check_arguments(input_ids, labels, config, hooks, sequence_parallel)
    hooks = hooks if hooks is not None else NO_HOOKS
    check_chunk_attention(config.chunk_attention, input_ids.device)
    if (labels is None) == (objective is None):
        raise ValueError("give either labels (the SFT objective) or objective=..., not both or neither")
    objective = objective if objective is not None else SFT(labels)
    _check_shapes(input_ids, objective.labels)
    layout = build_layout(attention_mask, position_ids, objective.mask, packing_refused=objective.packing_refused)
    parts = resolve_parts(unwrap(model))  # a DeepSpeedEngine: its module
    if not trainable(parts.model):  # as loss.backward() would: there is no gradient to give
        raise RuntimeError("no parameter of the model requires grad: unfreeze some (requires_grad_(True)) to train it")
    if not admitted:
        admit(parts, _self_check_step)
    if sequence_parallel is not None and any(carries_state(layer) for layer in parts.layers):
        raise UnsupportedModelError(
            "sequence-parallel StreamBP does not carry a linear-attention or SSM state from rank to rank; run the "
            "model on one rank per sequence (--sp 1)"
        )
    sync = grad_sync_for(model, parts, sequence_parallel=sequence_parallel is not None)  # FSDP2, DeepSpeed or none
    check_hooks_run(parts, sync.call)
    attention = ChunkAttention(config.chunk_attention, hooks)
    local = None  # one process holds the whole sequence
    if sequence_parallel is not None:  # this rank's positions, ids, objective and layer passes
        local = local_batch(
            sequence_parallel, parts, input_ids, objective, config=config, attention=attention, sync=sync,
            attention_mask=attention_mask, position_ids=position_ids,
        )  # fmt: skip
        input_ids, position_ids, objective, layout = local.input_ids, local.position_ids, local.objective, None
    balance = RouterBalance.of(parts.model, parts.layers, attention_mask, router_aux_loss_coef)
    if balance is not None and local is not None:
        raise UnsupportedModelError(
            "sequence-parallel StreamBP does not stream the router's load-balancing loss; pass "
            "router_aux_loss_coef=0 (or set config.output_router_logits = False)"
        )
    passes = local.passes if local is not None else ChunkedPasses(config, attention, layout, balance)
    if scale_wrt_gas:
        objective = sync.objective(objective)  # DeepSpeed: each chunk's gradient / accumulation steps
    if hooks.timer is not None:
        hooks.timer.start(input_ids.device)
    store = _store(config, len(parts.layers), hooks)
    summed = (
        nullcontext()
        if sequence_parallel is None
        else summed_gradients(sequence_parallel, trainable(parts.model), sync)
    )
    routed = nullcontext() if balance is None else balance.hooked()
    with summed, _streaming_mode(parts), sync.step(), closing(store), routed:  # close: frees what an error left
        counting = nullcontext() if balance is None else balance.counting(input_ids.shape[1], config.chunk_size)
        with hooks.timed(CHECKPOINT_PASS), counting:
            saved = forward_checkpoints(
                parts, input_ids, passes, store, gathered=sync.gathered, position_ids=position_ids,
                prepare_embedding=sync.gather_head,
            )  # fmt: skip
        store.rebuild_into = lambda index, source, sink: _rebuild(parts, saved, index, source, sink, sync)
        loss, grad, head_grads = _head(parts, saved, store, objective, config, hooks, sync)
        _layers_backward(parts, saved, store, grad, hooks, sync)
        if balance is not None and balance.loss is not None:
            loss = loss + balance.loss.to(loss.dtype)
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
    store = kind(placement, num_layers, kinds=hooks.kinds, shapes_only=steered(hooks).shapes_only)
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


def _layers_backward(parts: DecoderParts, saved: Checkpoints, store, grad, hooks: StepHooks, sync: GradSync) -> None:
    """Layers L-1 down to 0: each layer's chunked backward (saved.passes), its gradient reduced
    once, X_l freed."""
    progress, num_layers = hooks.progress, len(parts.layers)
    embed_trainable = bool(trainable(parts.embed))
    if progress is not None:
        progress(0, num_layers)
    for index in reversed(range(num_layers)):
        layer = parts.layers[index]
        sync.begin(layer)
        saved.passes.backward(
            index, layer, sync.call(layer), store.get(index, grad.device), grad, saved.layer_kwargs[index],
            need_input_grad=embed_trainable or index > 0,
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


def _rebuild(parts: DecoderParts, saved: Checkpoints, index: int, source, sink, sync: GradSync) -> None:
    """X_{index+1} into sink from X_index read from source, as the checkpoint pass made it (recompute
    placements; sequences.py). A sharded layer is gathered once for the whole rebuild, and its chunks
    run hook-free (grad_sync.py)."""
    layer = parts.layers[index]
    with timed(saved.layer_inputs.timer, REBUILD), torch.no_grad(), sync.rebuilding(layer):
        saved.passes.forward(index, layer, sync.call(layer), source, sink, saved.layer_kwargs[index])


def _check_arguments(input_ids, labels, config, hooks, sequence_parallel) -> None:
    """Arguments of the wrong kind or shape, each a TypeError or ValueError naming it, before any work.
    An object of another class with the attribute the step reads first passes (a test's stand-in)."""
    for name, value, kind, read in (
        ("config", config, StreamConfig, "chunk_size"),
        ("hooks", hooks, StepHooks, "timer"),
        ("sequence_parallel", sequence_parallel, SequenceParallel, "layout"),
    ):
        if value is not None and not isinstance(value, kind) and not hasattr(value, read):
            raise TypeError(
                f"{name} must be a {kind.__name__}, got {type(value).__name__}: pass {name}={kind.__name__}(...)"
            )
    for name, value in (("input_ids", input_ids), ("labels", labels)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a (batch, seq_len) int64 tensor, got {type(value).__name__}")
        if value is not None and value.dim() != 2:
            shape = tuple(value.shape)
            raise ValueError(
                f"{name} must be a (batch, seq_len) tensor, got shape {shape}: one sequence is {name}[None]"
            )


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
