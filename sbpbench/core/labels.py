"""Labels and targets as transformers defines them (`ForCausalLMLoss`), shared by every objective
(objectives.py), by the data builders and by the reference methods.

Logits at position t predict labels[t + 1] (`shift_labels`); labels equal to IGNORE_INDEX do not
count. transformers upcasts the logits to float32 for the loss; here the upcast is to at least
float32 (`loss_dtype`), so a float64 model keeps float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) labels -> (B, T) targets: target[:, t] = labels[:, t + 1], IGNORE_INDEX at the end."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def count_targets(targets: torch.Tensor) -> int:
    """Counted targets of the whole batch (HF normalises SFT over the batch); raises if there are none."""
    num = int((targets != IGNORE_INDEX).sum())
    if num == 0:
        raise ValueError(
            "no token to predict: every shifted label is -100 (a length-1 sequence has no next token); "
            "give at least one label after the first position"
        )
    return num


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype losses are computed in: float32, or float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


def sum_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits (..., V) in any dtype, targets (...) -> summed CE over counted targets, in loss_dtype."""
    logits = logits.to(loss_dtype(logits.dtype))
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
