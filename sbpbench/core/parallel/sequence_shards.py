"""Which positions of a sequence each rank of a sequence-parallel group holds, and the batch and
objective cut to them (the layouts: sequence_group.py).

Every rank is given the whole batch (B, T): the token ids are cheap, and the labels are shifted
and the loss's normalisers counted over the whole sequence before anything is cut, as Ulysses'
data adapter does with its `shift_labels`. T is padded at the end to a multiple of P (the padded
positions predict nothing and come after every real one, so causal attention never lets a real
position see them: their gradient is zero). Each rank then holds T_loc = T_pad / P positions, in
the same local chunks c (`chunk_bounds(T_loc, c)`), and every rank's local chunk j is one
contiguous range of global positions (`block`):

    contiguous    rank r holds [r T_loc, (r + 1) T_loc); its chunk [s, e) is [r T_loc + s, r T_loc + e)
    interleaved   chunk j of every rank side by side: with local chunk [s, e) of size n = e - s,
                  rank r's is [s P + r n, s P + (r + 1) n), so chunk step j covers [s P, e P) whole
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from functools import cached_property

import torch

from ..labels import IGNORE_INDEX
from ..layout import chunk_bounds


@dataclass(frozen=True)
class SequenceShards:
    """The positions of one step's sequence on each rank (module docstring)."""

    seq_len: int  # T, as given
    world: int  # P
    rank: int
    chunk_size: int  # c, local positions per chunk
    layout: str  # "contiguous" | "interleaved"

    @property
    def padded_len(self) -> int:
        return math.ceil(self.seq_len / self.world) * self.world

    @property
    def local_len(self) -> int:
        return self.padded_len // self.world

    @cached_property
    def chunks(self) -> list[tuple[int, int]]:
        """Local (start, end) of each chunk, the same on every rank."""
        return chunk_bounds(self.local_len, self.chunk_size)

    def block(self, rank: int, index: int) -> tuple[int, int]:
        """Global [start, end) of `rank`'s local chunk `index`."""
        start, end = self.chunks[index]
        if self.layout == "contiguous":
            offset = rank * self.local_len
            return offset + start, offset + end
        size = end - start
        return start * self.world + rank * size, start * self.world + (rank + 1) * size

    def runs(self, index: int) -> list[tuple[int, int]]:
        """The global ranges of chunk step `index` over all ranks, in rank order, adjacent ones
        merged: P ranges (contiguous) or one (interleaved). Each is one attention call."""
        return _merged(self.block(rank, index) for rank in range(self.world))

    def positions(self, rank: int | None = None) -> torch.Tensor:
        """(T_loc,) int64: the global position of each of `rank`'s local positions (default: this rank's)."""
        # one arange per merged range (contiguous: one, whatever T), so the ops that build them do not
        # grow with the chunk count: the memory simulator's short runs name them alike at every T
        ranges = [torch.arange(start, end) for start, end in self.ranges(rank)]
        return torch.cat(ranges) if ranges else torch.zeros(0, dtype=torch.int64)

    def shard(self, tensor: torch.Tensor, fill) -> torch.Tensor:
        """(B, T, ...) -> (B, T_loc, ...): padded at the end with `fill` to T_pad, this rank's positions."""
        pad = self.padded_len - tensor.shape[1]
        if pad:
            tail = tensor.new_full((tensor.shape[0], pad, *tensor.shape[2:]), fill)
            tensor = torch.cat([tensor, tail], dim=1)
        # slices of the tensor, not an index tensor: no op takes anything but the batch, so the
        # memory simulator runs them for real and the head can read the cut labels (simulate/sequence_parallel.py)
        return torch.cat([tensor[:, start:end] for start, end in self.ranges()], dim=1)

    def ranges(self, rank: int | None = None) -> list[tuple[int, int]]:
        """`rank`'s global [start, end) ranges in local order, adjacent ones merged (contiguous: one)."""
        rank = self.rank if rank is None else rank
        return _merged(self.block(rank, index) for index in range(len(self.chunks)))


def _merged(ranges) -> list[tuple[int, int]]:
    """[start, end) ranges in order, each one that starts where the previous ends joined to it."""
    merged: list[list[int]] = []
    for start, end in ranges:
        if merged and merged[-1][1] == start:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def shard_objective(objective, shards: SequenceShards, reduce, grad_scale: float = 1.0):
    """A copy of `objective` whose per-position tensors ((B, T, ...) attributes: labels, targets,
    mask, GRPO's log-probs and weights) hold this rank's positions; what the objective computed
    over the whole sequence (normalisers, counts, per-row terms) stays as it is. Sequence sums
    (DPO, GSPO) are summed over the group by reduce(tensor) before `prepare`. grad_scale: each
    chunk's loss is multiplied by it and the returned loss divided by it (an engine that averages
    gradients over the sequence-parallel ranks as over data ranks)."""
    batch, seq_len = objective.labels.shape
    local = copy.copy(objective)
    for name, value in vars(objective).items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (batch, seq_len):
            setattr(local, name, shards.shard(value, _fill(value)))
    cls = type(objective)
    if objective.needs_sequence_sums:
        local.prepare = lambda sums: cls.prepare(local, reduce(sums.clone()))
    if grad_scale != 1.0:
        local.chunk_loss = lambda logits, start, end: cls.chunk_loss(local, logits, start, end) * grad_scale
        local.streamed_loss = lambda total: cls.streamed_loss(local, total / grad_scale)
    return local


def _fill(tensor: torch.Tensor):
    """The value of a padded position: not counted (a label, a mask), or zero."""
    if tensor.dtype == torch.bool:
        return False
    return IGNORE_INDEX if not tensor.dtype.is_floating_point else 0.0
