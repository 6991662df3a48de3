"""Accelerate's DeepSpeed sequence parallelism in the StreamBP trainers: the local shards that
DeepSpeed's `UlyssesSPDataLoaderAdapter` hands each rank, put back together into the whole batch
that `stream_backward(..., sequence_parallel=...)` takes, and the target count the loss is
normalised by.

`TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=P))` with a
DeepSpeed config makes Accelerate 1.15 build ALST's groups (`register_with_transformers`, given to
`deepspeed.initialize` as its mpu) and wrap the training dataloader in DeepSpeed 0.19's adapter. The
adapter gathers one batch from each rank of a group; for each of them in turn, every rank gets its
contiguous T/P slice of input_ids, position_ids, attention_mask (where the collator made one) and
`shift_labels`, the labels shifted over the whole sequence (-100 last) in place of `labels`. T must
be a multiple of P: the adapter raises otherwise and pads nothing. So every rank of a group steps on
the same micro-batch, and `whole_batch` gathers the slices back, one all_gather per tensor:

    labels[:, 0] = -100,  labels[:, t] = shift_labels[:, t - 1]   (the last shift label is -100)

The Trainer does not count `num_items_in_batch` under this adapter (its batches have no `labels`; it
sets `model_accepts_loss_kwargs` False, and its own loss is each micro-batch's mean over the
accumulation steps). `count_targets` counts the shift labels of the accumulation window, summed
over the group (over every process under `average_tokens_across_devices`), so the loss is
normalised by the whole window's targets, as without sequence parallelism.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..core import IGNORE_INDEX, SequenceParallel

# What the adapter hands a rank of a StreamBP trainer's causal-LM batch (each (B, T/P)).
SHARDED_KEYS = ("input_ids", "shift_labels", "position_ids", "attention_mask")


def deepspeed_sequence_parallel(accelerator) -> bool:
    """Whether Accelerate runs DeepSpeed's Ulysses sequence parallelism (sp_backend "deepspeed", sp_size > 1)."""
    config = getattr(accelerator, "parallelism_config", None)
    return bool(getattr(config, "sp_enabled", False)) and getattr(config, "sp_backend", None) == "deepspeed"


def whole_batch(inputs: Mapping[str, Any], group: SequenceParallel) -> dict[str, torch.Tensor]:
    """This rank's slices (B, T/P) -> the group's whole batch (B, T): input_ids and labels, the one
    layout StreamBP's sequence parallelism takes (one unpadded sequence per row from position 0).
    Right padding is kept as -100 labels: the pads come after every real token, so causal attention
    never shows them to one. Raises ValueError on what it cannot rebuild exactly."""
    if "shift_labels" not in inputs:
        raise ValueError(
            "under sequence parallelism the batch comes from DeepSpeed's Ulysses data adapter, with shift_labels; "
            "this one has none: use a collator that sets labels"
        )
    whole = {key: _gather(inputs[key], group) for key in SHARDED_KEYS if inputs.get(key) is not None}
    shift = whole["shift_labels"]  # (B, T): shift[:, t] is the target of position t
    assert bool((shift[:, -1] == IGNORE_INDEX).all()), "the adapter shifts with -100 last"
    labels = torch.cat([torch.full_like(shift[:, :1], IGNORE_INDEX), shift[:, :-1]], dim=1)  # (B, T)
    real = whole.get("attention_mask")
    if real is not None:
        real = real.bool()
        if bool((real[:, 1:] & ~real[:, :-1]).any()) or bool((shift[~real] != IGNORE_INDEX).any()):
            raise ValueError(
                "sequence parallelism takes right-padded rows with -100 labels on the pads (a pad ahead of a token, "
                "or a target on a pad, would need the attention mask): pad on the right, as TRL's and "
                "transformers' causal-LM collators do"
            )
    positions = whole.get("position_ids")
    if positions is not None:
        expected = torch.arange(positions.shape[1], device=positions.device).expand_as(positions)
        counted = real if real is not None else torch.ones_like(positions, dtype=torch.bool)
        if bool((positions != expected)[counted].any()):
            raise ValueError(
                "sequence parallelism takes one sequence per row from position 0; these position_ids restart within "
                "a row (packing or padding-free): set packing=False and padding_free=False"
            )
    return {"input_ids": whole["input_ids"], "labels": labels}


def count_targets(
    batch_samples: list[Mapping[str, Any]], group: SequenceParallel, every_process: bool, device: torch.device
) -> torch.Tensor | None:
    """The targets (shift labels other than -100) of the accumulation window's micro-batches: this
    rank's slices summed over the group, or over every process (each target counted once: a group's
    ranks hold disjoint slices). None where the batches have no shift_labels."""
    if not batch_samples or any("shift_labels" not in batch for batch in batch_samples):
        return None
    count = sum(int((batch["shift_labels"] != IGNORE_INDEX).sum()) for batch in batch_samples)
    count = torch.tensor(count, dtype=torch.int64, device=device)
    dist.all_reduce(count, group=None if every_process else group.group)
    return count


def _gather(local: torch.Tensor, group: SequenceParallel) -> torch.Tensor:
    """(B, T/P) on each rank -> (B, T), rank 0's slice first (the adapter's contiguous layout)."""
    local = local.contiguous()
    pieces = [torch.empty_like(local) for _ in range(group.world)]
    dist.all_gather(pieces, local, group=group.group)
    return torch.cat(pieces, dim=1)
