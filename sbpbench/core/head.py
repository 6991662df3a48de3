"""Final norm + lm_head + objective, streamed along the sequence (StreamBP paper, Sec. 3.1 and 3.3).

Logits exist for one chunk of positions at a time, (B, c, V), never for the whole sequence. Each
chunk's backward leaves its final-norm and lm_head weight gradients (accumulated across chunks)
and writes dL/dZ for its positions, where Z is the last decoder layer's output. Z and dL/dZ are
read and written chunk by chunk (sequences.py): on the device, or in host memory (stream placement). An objective that
is a nonlinear function of whole-sequence sums (DPO, GSPO) first takes a no-grad pass over the chunks
for those sums (objectives/base.py), so its head costs two lm_head forwards instead of one.
core/README.md, "Head and loss".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .architecture.head_call import ModelHead
from .architecture.parts import DecoderParts
from .grad_accum import ChunkGradAccumulator
from .labels import loss_dtype
from .layout import chunk_bounds
from .memory_kinds import LOGITS, KindListener, allocating
from .objectives import Objective


def counted_chunks(seq_len: int, chunk_size: int, objective: Objective) -> list[tuple[int, int]]:
    """(start, end) of each chunk holding at least one counted target (others have zero gradient).
    One read of the device for all chunks: a read per chunk would stall the device's queue per chunk."""
    bounds = chunk_bounds(seq_len, chunk_size)
    counted = objective.mask.any(dim=0)  # (T,): some row counts the position
    counted = torch.cat([counted, counted.new_zeros(len(bounds) * chunk_size - seq_len)])  # whole chunks
    flags = counted.view(len(bounds), chunk_size).any(dim=1).tolist()
    return [bound for bound, flag in zip(bounds, flags) if flag]


@torch.no_grad()
def sequence_sums(
    objective: Objective,
    logits_of,
    bounds: list[tuple[int, int]],
    hidden,
    dtype: torch.dtype,
    kinds: KindListener | None = None,
) -> torch.Tensor:
    """Pass 1 for objectives of whole-sequence sums (DPO, GSPO): their (B, J) sums, no graph.
    logits_of(hidden): the (B, c, V) logits of a chunk's hidden states; bounds: the counted chunks;
    hidden: the last layer's output (sequences.py); dtype: its dtype; kinds: told what the logits are."""
    sums = None
    for (start, end), chunk in zip(bounds, hidden.chunks(bounds)):
        with allocating(kinds, LOGITS):
            part = objective.sequence_sums(logits_of(chunk), start, end)
        sums = part if sums is None else sums + part
    if sums is None:  # nothing counted: the sums over no positions
        empty = torch.zeros(objective.labels.shape[0], 0, dtype=loss_dtype(dtype), device=objective.labels.device)
        sums = objective.token_values(empty, 0, 0).sum(dim=1)
    return sums


def head_backward(
    parts: DecoderParts,
    last_hidden,
    grad_hidden,
    objective: Objective,
    *,
    chunk_size: int,
    accumulator: ChunkGradAccumulator,
    call: Callable[[nn.Module], Callable] = lambda module: module,
    kinds: KindListener | None = None,
) -> torch.Tensor:
    """last_hidden (B, T, d): the last layer's output; grad_hidden (B, T, d): where dZ goes, in the
    hidden dtype (both sequences.py; one host buffer under the stream placement: each chunk's dZ
    written over that chunk of Z once read). Returns the loss. The chunks' norm and lm_head weight
    gradients are collected into `accumulator`; the caller finishes it. call(module): what to run
    for the final norm and the lm_head (a sharded unit's hook-free forward: grad_sync.py). kinds:
    a memory-kind listener told what the logits are (memory_kinds.py)."""
    seq_len, dtype = last_hidden.shape[1], last_hidden.dtype
    counted = counted_chunks(seq_len, chunk_size, objective)
    head = ModelHead(parts, call)  # the model's own logits of a chunk (head_call.py)
    if objective.needs_sequence_sums:
        objective.prepare(sequence_sums(objective, head.logits, counted, last_hidden, dtype, kinds))
    total = torch.zeros((), dtype=loss_dtype(dtype), device=last_hidden.device)
    for (start, end), chunk in zip(counted, last_hidden.chunks(counted)):
        hidden = chunk.detach().requires_grad_()
        with allocating(kinds, LOGITS):
            with torch.enable_grad():
                part = objective.chunk_loss(head.logits(hidden), start, end)
            part.backward()
        grad_hidden.write(start, end, hidden.grad)
        total += part.detach()
        accumulator.collect()
    for start, end in _uncounted(seq_len, counted):
        grad_hidden.zero(start, end)  # no target after them: a zero gradient, as BP's
    return objective.streamed_loss(total)


def _uncounted(seq_len: int, counted: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges of [0, seq_len) outside the counted chunks."""
    gaps, done = [], 0
    for start, end in counted:
        if start > done:
            gaps.append((done, start))
        done = end
    return gaps + ([(done, seq_len)] if done < seq_len else [])
