"""What a StreamBP step does differently when P ranks share the sequence (sequence_group.py): the
checks before any work, the batch and the objective cut to this rank's positions, and the
parameter gradients summed over the group.

Each rank's chunks give the gradient of its positions' share of the loss; the step's gradient is
their sum over the group. In one process per rank (no data-parallel engine) the step sums them
itself, one all-reduce per parameter after the step, the gradients already in `.grad` (gradient
accumulation) set aside and added back after. Under FSDP2 or DeepSpeed the engine reduces them:
FSDP2 sharded over a flattened dp_shard x sp mesh (as torchtitan does) averages over every rank, so
each rank's loss is scaled by P and the average is the data ranks' mean of whole-sequence
gradients; DeepSpeed's divisor depends on its stage (`GradSync.sequence_parallel_scale`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..architecture.parts import DecoderParts
from ..attention import ChunkAttention
from ..config import StreamConfig
from .grad_sync_base import GradSync, NoSync
from .sequence_group import LAYOUTS, SequenceParallel
from .sequence_layer import SequenceParallelStep
from .sequence_shards import SequenceShards, shard_objective


@dataclass
class LocalBatch:
    """This rank's share of the step: (B, T_loc) token ids, (1, T_loc) global positions, the objective."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    objective: object
    passes: SequenceParallelStep  # the layers' passes over this rank's chunks


def check_heads(config, world: int) -> None:
    """Ulysses splits heads over the ranks: H divisible by P, and h_kv by P or P by h_kv."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % world:
        raise ValueError(
            f"sequence parallelism over {world} ranks needs the query heads ({heads}) divisible by {world}"
        )
    if kv_heads % world and world % kv_heads:
        raise ValueError(
            f"sequence parallelism over {world} ranks needs the key/value heads ({kv_heads}) divisible by {world}, "
            f"or {world} divisible by them (each head then repeated on {world} // {kv_heads} ranks)"
        )


def local_batch(
    group: SequenceParallel,
    parts: DecoderParts,
    input_ids: torch.Tensor,
    objective,
    *,
    config: StreamConfig,
    attention: ChunkAttention,
    sync: GradSync,
    attention_mask=None,
    position_ids=None,
) -> LocalBatch:
    """Check, agree and cut (module docstring); raises ValueError, on every rank alike, before work."""
    if position_ids is not None:
        raise ValueError("sequence parallelism takes one sequence per row from position 0: no position_ids (packing)")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("sequence parallelism takes unpadded rows: give attention_mask=None (or all ones)")
    check_heads(parts.config, group.world)
    batch, seq_len = input_ids.shape
    chunk_size, logits_chunk_size = config.chunk_size, config.logits_chunk_size
    group.agree(
        device=input_ids.device, batch=batch, seq_len=seq_len, chunk_size=chunk_size, logits_chunk_size=logits_chunk_size,
        layout=LAYOUTS.index(group.layout), num_layers=len(parts.layers),
    )  # fmt: skip
    shards = SequenceShards(seq_len, group.world, group.rank, chunk_size, group.layout)
    scale = sync.sequence_parallel_scale(group.world)  # 1 where the step or the engine sums over the group
    local = shard_objective(objective, shards, group.all_reduce, grad_scale=scale)
    positions = shards.positions().to(input_ids.device)
    return LocalBatch(
        input_ids=shards.shard(input_ids, 0), position_ids=positions[None], objective=local,
        passes=SequenceParallelStep(group, shards, config, attention),
    )  # fmt: skip


@contextmanager
def summed_gradients(group: SequenceParallel, params: list[torch.nn.Parameter], sync: GradSync):
    """One process per rank: the step's gradients summed over the group, what `.grad` held before
    kept out of the sum and added back after. Under a data-parallel engine, nothing: it reduces."""
    if type(sync) is not NoSync:
        yield
        return
    saved = {}
    for param in params:
        saved[id(param)], param.grad = param.grad, None
    try:
        yield
    except BaseException:  # a failed step adds nothing: .grad as it was
        for param in params:
            param.grad = saved[id(param)]
        raise
    for param in params:  # every rank the same parameters, in the same order: a rank without a gradient sends zeros
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if grad.dtype in (torch.float16, torch.bfloat16):
            grad = group.all_reduce(grad.float()).to(param.dtype)  # summed in fp32, rounded once
        else:
            grad = group.all_reduce(grad)
        previous = saved[id(param)]
        param.grad = grad if previous is None else previous.add_(grad)


def reduce_loss(group: SequenceParallel, loss: torch.Tensor, objective) -> torch.Tensor:
    """The step's loss: the ranks' chunk sums added, unless the objective's is already whole (sequence sums)."""
    return loss if objective.needs_sequence_sums else group.all_reduce(loss.clone())
