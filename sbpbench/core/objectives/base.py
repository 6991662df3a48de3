"""What every objective shares: targets, token log-probs, the streaming protocol; and SFT.

Each objective depends on the logits only through the log-probability of each target token,
logp[b, t] = log_softmax(logits[b, t] / temperature)[labels[b, t + 1]] (targets are the labels
shifted by one, as in transformers; -100 marks positions that do not count). That is what lets
StreamBP compute it chunk by chunk (head.py) while `bp` and `ckpt` compute it from the full logits
(`full_loss`).

Streaming protocol (head.py): if `needs_sequence_sums`, pass 1 (no grad) calls `sequence_sums`
chunk by chunk and hands the (B, J) totals to `prepare`; then for each chunk
`chunk_loss(logits, start, end)` is a scalar whose gradient is exactly the loss's gradient through
that chunk's logits, and `streamed_loss(total)` turns the sum of the chunk values into the loss
(core/README.md, "Head and loss").

Losses are computed in at least float32 (float64 for a float64 model), as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..labels import IGNORE_INDEX, count_targets, loss_dtype, shift_labels, sum_cross_entropy


def token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(B, c, V) logits, (B, c) targets -> (B, c) log-prob of each target in loss_dtype, the logits
    divided by temperature first (TRL's GRPO); 0 where the target is IGNORE_INDEX."""
    logits = logits.to(loss_dtype(logits.dtype))
    if temperature != 1.0:
        logits = logits / temperature
    nll = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")
    return -nll


@dataclass(eq=False)
class Objective:
    """Base: `labels` (B, T) unshifted, -100 where a token does not count."""

    labels: torch.Tensor
    name = "objective"
    temperature = 1.0  # the logits are divided by it before the log-softmax (GRPO sets its own)
    # Why packed rows (position_ids restarting, layout.py) cannot take this objective; None: they can.
    packing_refused: ClassVar[str | None] = "the objective's terms are per row, not per packed document"

    def __post_init__(self):
        self.targets = shift_labels(self.labels)  # (B, T): what position t predicts
        self.mask = self.targets != IGNORE_INDEX  # (B, T) bool
        self.num_targets = int(self.mask.sum())

    def logps(self, logits: torch.Tensor, start: int = 0) -> torch.Tensor:
        """(B, c) target log-probs of the chunk's logits (B, c, V) starting at position `start`."""
        return token_logps(logits, self.targets[:, start : start + logits.shape[1]], self.temperature)

    def masked(self, logps: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Zero the log-probs of positions that do not count (start: the chunk's first position)."""
        mask = self.mask[:, start : start + logps.shape[1]]
        return torch.where(mask, logps, torch.zeros_like(logps))

    def full_loss(self, logits: torch.Tensor) -> torch.Tensor:
        """The loss from full (B, T, V) logits: the reference `bp` and `ckpt` use."""
        return self.loss_from_logps(self.logps(logits))

    def loss_from_logps(self, logps: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def chunk_loss(self, logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Scalar whose gradient w.r.t. logits[:, start:end] is the loss's; separable objectives
        return their own terms, so the chunk values sum to the loss."""
        return self.loss_from_logps_chunk(self.logps(logits, start), start, end)

    def loss_from_logps_chunk(self, logps: torch.Tensor, start: int, end: int) -> torch.Tensor:
        raise NotImplementedError

    def streamed_loss(self, chunk_total: torch.Tensor) -> torch.Tensor:
        return chunk_total

    @property
    def needs_sequence_sums(self) -> bool:
        return False


@dataclass(eq=False)
class SequenceSumsObjective(Objective):
    """A loss that is a function of per-row sums S[b, j] = sum_t values(logp)[b, t, j] (DPO: the
    sequence log-prob; GSPO: the log-ratio and the KL). Its gradient through logp[b, t] is
    sum_j dL/dS[b, j] x d values[b, t, j] / d logp[b, t], so pass 1 computes S, `prepare` the loss
    and w = dL/dS (B, J) by autograd, and pass 2's chunk value sum_{b,t,j} w[b, j] values[b, t, j]
    has exactly the loss's gradient: the head costs two lm_head forwards."""

    _weights: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def needs_sequence_sums(self) -> bool:
        return True

    def token_values(self, logps: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """(B, c) log-probs of positions [start, end) -> (B, c, J), 0 where not counted."""
        raise NotImplementedError

    def loss_from_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """(B, J) sums -> the loss."""
        raise NotImplementedError

    def loss_from_logps(self, logps: torch.Tensor) -> torch.Tensor:
        return self.loss_from_sums(self.token_values(logps, 0, logps.shape[1]).sum(dim=1))

    def sequence_sums(self, logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Pass 1: the chunk's (B, J) share of the sums."""
        return self.token_values(self.logps(logits, start), start, end).sum(dim=1)

    def prepare(self, sums: torch.Tensor) -> None:
        """The loss and dL/dS from pass 1's (B, J) sums."""
        sums = sums.detach().requires_grad_()
        with torch.enable_grad():
            loss = self.loss_from_sums(sums)
            (weights,) = torch.autograd.grad(loss, sums)
        self._loss, self._weights = loss.detach(), weights

    def loss_from_logps_chunk(self, logps: torch.Tensor, start: int, end: int) -> torch.Tensor:
        # d/dlogp[b, t] of this surrogate = sum_j dL/dS[b, j] d values[b, t, j]: the loss's gradient
        return (self.token_values(logps, start, end) * self._weights[:, None, :].to(logps.dtype)).sum()

    def streamed_loss(self, chunk_total: torch.Tensor) -> torch.Tensor:
        return self._loss.to(chunk_total.dtype)


@dataclass(eq=False)
class SFT(Objective):
    """Token cross-entropy summed over the batch's counted tokens, divided by num_items_in_batch
    (transformers' `labels=` loss; the Trainer passes the count of the whole accumulation window)
    or, when None, by this batch's own count; then by gradient_accumulation_steps (what the Trainer
    does to a loss it could not give num_items_in_batch). A row without counted labels adds 0; a
    batch without any is refused unless num_items_in_batch is given (its loss is then 0)."""

    num_items_in_batch: int | float | None = None
    gradient_accumulation_steps: int = 1
    name = "sft"
    packing_refused = None

    def __post_init__(self):
        super().__post_init__()
        if self.num_items_in_batch is None:
            count_targets(self.targets)  # raises: nothing to predict
        elif not float(self.num_items_in_batch) > 0:  # a number, or the Trainer's 0-dim tensor (read once)
            raise ValueError(f"sft: num_items_in_batch must be positive, got {self.num_items_in_batch}")
        items = self.num_targets if self.num_items_in_batch is None else float(self.num_items_in_batch)
        self.denominator = items * self.gradient_accumulation_steps

    def full_loss(self, logits: torch.Tensor) -> torch.Tensor:
        return sum_cross_entropy(logits, self.targets) / self.denominator

    def chunk_loss(self, logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return sum_cross_entropy(logits, self.targets[:, start:end]) / self.denominator

    def loss_from_logps(self, logps: torch.Tensor) -> torch.Tensor:
        return -self.masked(logps).sum() / self.denominator
