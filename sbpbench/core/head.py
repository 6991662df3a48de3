"""Final norm + lm_head + objective, streamed along the sequence (StreamBP paper, Sec. 3.1 and 3.3).

Logits exist for one chunk of positions at a time, (B, c, V), never for the whole sequence. Each
chunk's backward leaves its final-norm and lm_head weight gradients (accumulated across chunks)
and writes dL/dZ for its positions, where Z is the last decoder layer's output. An objective that
is a nonlinear function of whole-sequence sums (DPO, GSPO) first takes a no-grad pass over the chunks
for those sums (objectives/base.py), so its head costs two lm_head forwards instead of one.
core/README.md, "Head and loss".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .adapters import DecoderParts
from .chunking import chunk_bounds
from .grad_accum import ChunkGradAccumulator
from .labels import loss_dtype
from .memory_kinds import LOGITS, allocating
from .objectives import Objective


def _chunk_logits(parts: DecoderParts, hidden: torch.Tensor, call: Callable[[nn.Module], Callable]) -> torch.Tensor:
    logits = call(parts.lm_head)(call(parts.norm)(hidden))  # (B, c, V) in the model dtype
    cap = parts.final_logit_softcap
    if cap is not None:  # Gemma-style softcapping, applied before the upcast as transformers does
        logits = torch.tanh(logits / cap) * cap
    return logits


def counted_chunks(seq_len: int, chunk_size: int, objective: Objective) -> list[tuple[int, int]]:
    """(start, end) of each chunk holding at least one counted target (others have zero gradient).
    One read of the device for all chunks: a read per chunk would stall the device's queue per chunk."""
    bounds = chunk_bounds(seq_len, chunk_size)
    counted = objective.mask.any(dim=0)  # (T,): some row counts the position
    counted = torch.cat([counted, counted.new_zeros(len(bounds) * chunk_size - seq_len)])  # whole chunks
    flags = counted.view(len(bounds), chunk_size).any(dim=1).tolist()
    return [bound for bound, flag in zip(bounds, flags) if flag]


@torch.no_grad()
def sequence_sums(objective: Objective, logits_of, seq_len: int, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Pass 1 for objectives of whole-sequence sums (DPO, GSPO): their (B, J) sums, no graph.
    logits_of(start, end): the (B, c, V) logits of a chunk; dtype: the hidden states' dtype."""
    sums = None
    for start, end in counted_chunks(seq_len, chunk_size, objective):
        with allocating(LOGITS):
            part = objective.sequence_sums(logits_of(start, end), start, end)
        sums = part if sums is None else sums + part
    if sums is None:  # nothing counted: the sums over no positions
        empty = torch.zeros(objective.labels.shape[0], 0, dtype=loss_dtype(dtype), device=objective.labels.device)
        sums = objective.token_values(empty, 0, 0).sum(dim=1)
    return sums


def head_backward(
    parts: DecoderParts,
    last_hidden: torch.Tensor,
    objective: Objective,
    *,
    chunk_size: int,
    accumulator: ChunkGradAccumulator,
    call: Callable[[nn.Module], Callable] = lambda module: module,
) -> tuple[torch.Tensor, torch.Tensor]:
    """last_hidden (B, T, d): last layer output. Returns (loss, dZ) with dZ (B, T, d) in the hidden
    dtype. The chunks' norm and lm_head weight gradients are collected into `accumulator`; the
    caller finishes it. call(module): what to run for the final norm and the lm_head (a sharded
    unit's hook-free forward: grad_sync.py)."""
    seq_len = last_hidden.shape[1]
    if objective.needs_sequence_sums:
        logits_of = lambda start, end: _chunk_logits(parts, last_hidden[:, start:end], call)
        objective.prepare(sequence_sums(objective, logits_of, seq_len, chunk_size, last_hidden.dtype))
    grad_hidden = torch.zeros_like(last_hidden)
    total = torch.zeros((), dtype=loss_dtype(last_hidden.dtype), device=last_hidden.device)
    for start, end in counted_chunks(seq_len, chunk_size, objective):
        hidden = last_hidden[:, start:end].detach().requires_grad_()
        with allocating(LOGITS):
            with torch.enable_grad():
                part = objective.chunk_loss(_chunk_logits(parts, hidden, call), start, end)
            part.backward()
        grad_hidden[:, start:end] = hidden.grad
        total += part.detach()
        accumulator.collect()
    return objective.streamed_loss(total), grad_hidden
