"""Training objectives as typed objects, shared by every method.

Each objective depends on the logits only through the log-probability of each target token,
logp[b, t] = log_softmax(logits[b, t])[labels[b, t + 1]] (targets are the labels shifted by one, as
in transformers; -100 marks positions that do not count). That is what lets StreamBP compute it
chunk by chunk (head.py) while `bp` and `ckpt` compute it from the full logits (`full_loss`):

- SFT: mean cross-entropy over every counted token of the batch (transformers' ForCausalLMLoss).
- GRPO: per-token clipped importance-ratio objective plus a k3 KL penalty to a reference policy
  (DeepSeekMath, arXiv 2402.03300, eq. 3-4; TRL's GRPOTrainer `_compute_loss`), per-token
  independent, so each chunk's terms and gradients are final on their own.
- DPO: sigmoid loss on (chosen, rejected) pairs (Rafailov et al., arXiv 2305.18290, eq. 7; TRL's
  DPOTrainer `dpo_loss` with loss_type="sigmoid"): a nonlinear function of whole-sequence
  log-prob sums. Its gradient is a per-sequence scalar times per-token terms, so the streamed
  version needs TWO passes over the head: pass 1 (no grad) sums each sequence's log-probs, pass 2
  backpropagates the per-token log-probs scaled by that sequence's scalar.

Streaming protocol (head.py): if `needs_sequence_logps`, pass 1 calls `sequence_logps` chunk by
chunk and `prepare(sums)`; then for each chunk `chunk_loss(logits, start, end)` is a scalar whose
gradient is exactly the loss's gradient through that chunk's logits, and `streamed_loss(total)`
turns the sum of the chunk values into the loss (core/README.md, "Head and loss").

Losses are computed in at least float32 (float64 for a float64 model), as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .labels import IGNORE_INDEX, count_targets, loss_dtype, shift_labels, sum_cross_entropy

GRPO_NORMALIZATIONS = ("sequence", "token")


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, c, V) logits, (B, c) targets -> (B, c) log-prob of each target in loss_dtype; 0 where
    the target is IGNORE_INDEX."""
    logits = logits.to(loss_dtype(logits.dtype))
    nll = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")
    return -nll


@dataclass(eq=False)
class Objective:
    """Base: `labels` (B, T) unshifted, -100 where a token does not count."""

    labels: torch.Tensor
    needs_sequence_logps = False
    name = "objective"

    def __post_init__(self):
        self.targets = shift_labels(self.labels)  # (B, T): what position t predicts
        self.mask = self.targets != IGNORE_INDEX  # (B, T) bool
        self.num_targets = count_targets(self.targets)

    def masked(self, logps: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Zero the log-probs of positions that do not count (start: the chunk's first position)."""
        mask = self.mask[:, start : start + logps.shape[1]]
        return torch.where(mask, logps, torch.zeros_like(logps))

    def full_loss(self, logits: torch.Tensor) -> torch.Tensor:
        """The loss from full (B, T, V) logits: the reference `bp` and `ckpt` use."""
        return self.loss_from_logps(token_logps(logits, self.targets))

    def loss_from_logps(self, logps: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def chunk_loss(self, logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Scalar whose gradient w.r.t. logits[:, start:end] is the loss's; separable objectives
        return their own terms, so the chunk values sum to the loss."""
        return self.loss_from_logps_chunk(token_logps(logits, self.targets[:, start:end]), start, end)

    def loss_from_logps_chunk(self, logps: torch.Tensor, start: int, end: int) -> torch.Tensor:
        raise NotImplementedError

    def streamed_loss(self, chunk_total: torch.Tensor) -> torch.Tensor:
        return chunk_total

    def sequence_logps(self, logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """(B,) sum of the chunk's counted target log-probs (DPO's pass 1)."""
        return token_logps(logits, self.targets[:, start:end]).sum(dim=1)

    def prepare(self, sequence_logps: torch.Tensor) -> None:
        """Receives pass 1's (B,) sums before pass 2 (only if needs_sequence_logps)."""


@dataclass(eq=False)
class SFT(Objective):
    """Mean token cross-entropy over the batch's counted tokens (transformers' `labels=` loss)."""

    name = "sft"

    def full_loss(self, logits: torch.Tensor) -> torch.Tensor:
        return sum_cross_entropy(logits, self.targets) / self.num_targets

    def chunk_loss(self, logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return sum_cross_entropy(logits, self.targets[:, start:end]) / self.num_targets

    def loss_from_logps(self, logps: torch.Tensor) -> torch.Tensor:
        return -self.masked(logps).sum() / self.num_targets


@dataclass(eq=False)
class GRPO(Objective):
    """GRPO's clipped surrogate with a k3 KL penalty, to be minimised.

    Per counted token (completion tokens only; prompt and padding labels are -100):
        ratio = exp(logp - old_logp)
        pg    = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)
        kl    = exp(ref_logp - logp) - (ref_logp - logp) - 1              (k3, always >= 0)
        term  = pg + beta * kl
    normalization "sequence": mean over each sequence's tokens, then mean over sequences
    (DeepSeekMath's 1/G sum_i 1/|o_i| sum_t; TRL's loss_type="grpo"); "token": sum over all
    tokens / their count (DAPO; TRL's "dapo"/"bnpo" for one process).

    advantages (B,): one per sequence (a group's rows share a prompt). old_logps / ref_logps
    (B, T): per target position, as `targets`. old_logps None means on-policy (one optimisation
    step per generation, TRL's default): old = the current log-probs, detached, so ratio == 1.
    """

    advantages: torch.Tensor = None
    ref_logps: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    beta: float = 0.04  # KL weight (DeepSeekMath)
    epsilon: float = 0.2
    epsilon_high: float | None = None  # DAPO's clip-higher; None: = epsilon
    normalization: str = "sequence"
    name = "grpo"

    def __post_init__(self):
        super().__post_init__()
        batch = self.labels.shape[0]
        if self.advantages is None or self.advantages.shape != (batch,):
            raise ValueError(f"grpo: advantages must be one per sequence, shape ({batch},)")
        for name in ("ref_logps", "old_logps"):
            value = getattr(self, name)
            if value is not None and value.shape != self.labels.shape:
                raise ValueError(f"grpo: {name} must be (batch, seq_len) = {tuple(self.labels.shape)}")
        if self.beta != 0 and self.ref_logps is None:
            raise ValueError("grpo: a KL penalty (beta != 0) needs ref_logps; pass them or set beta=0")
        if self.normalization not in GRPO_NORMALIZATIONS:
            raise ValueError(f"grpo: normalization must be one of {', '.join(GRPO_NORMALIZATIONS)}")
        counts = self.mask.sum(dim=1)  # (B,) completion tokens per sequence
        if self.normalization == "sequence":
            if bool((counts == 0).any()):
                raise ValueError("grpo: every sequence needs at least one completion token for per-sequence means")
            per_row = 1.0 / (counts.to(torch.float64) * self.labels.shape[0])
            self.weights = per_row[:, None].expand_as(self.mask) * self.mask  # (B, T)
        else:
            self.weights = self.mask.to(torch.float64) / self.num_targets

    def _terms(self, logps: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """(B, c) per-token loss terms for target positions [start, end)."""
        mask = self.mask[:, start:end]
        old = logps.detach() if self.old_logps is None else self.old_logps[:, start:end].to(logps.dtype)
        advantages = self.advantages.to(logps.dtype)[:, None]
        ratio = torch.exp(logps - old)
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + high)
        terms = -torch.min(ratio * advantages, clipped * advantages)
        if self.beta != 0:
            delta = self.ref_logps[:, start:end].to(logps.dtype) - logps
            terms = terms + self.beta * (torch.exp(delta) - delta - 1)
        return torch.where(mask, terms, torch.zeros_like(terms))

    def loss_from_logps_chunk(self, logps: torch.Tensor, start: int, end: int) -> torch.Tensor:
        weights = self.weights[:, start:end].to(logps.dtype)
        return (self._terms(logps, start, end) * weights).sum()

    def loss_from_logps(self, logps: torch.Tensor) -> torch.Tensor:
        return self.loss_from_logps_chunk(logps, 0, logps.shape[1])


@dataclass(eq=False)
class DPO(Objective):
    """DPO's sigmoid loss. Rows [0, P) are the chosen responses and rows [P, 2P) the rejected ones
    of the same P prompts (TRL's concatenated layout); labels are -100 on the prompt and padding.

        s_i      = sum of the response's token log-probs under the policy
        margin_p = beta * ((s_chosen - ref_chosen) - (s_rejected - ref_rejected))
        loss     = mean_p -log sigmoid(margin_p)

    ref_logps (2P,): the reference model's sequence log-probs in the same row order, computed
    beforehand (a frozen reference model, or the LoRA model with adapters disabled).
    """

    ref_logps: torch.Tensor = None
    beta: float = 0.1
    needs_sequence_logps = True
    name = "dpo"
    _weights: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self):
        super().__post_init__()
        rows = self.labels.shape[0]
        if rows % 2:
            raise ValueError(f"dpo: needs (chosen, rejected) pairs: an even number of rows, got {rows}")
        if self.ref_logps is None or self.ref_logps.shape != (rows,):
            raise ValueError(f"dpo: ref_logps must be one per row, shape ({rows},)")
        if bool((self.mask.sum(dim=1) == 0).any()):
            raise ValueError("dpo: every chosen and rejected response needs at least one counted token")

    def _loss_from_sums(self, sums: torch.Tensor) -> torch.Tensor:
        pairs = sums.shape[0] // 2
        rewards = sums - self.ref_logps.to(sums.dtype)
        margin = self.beta * (rewards[:pairs] - rewards[pairs:])
        return -F.logsigmoid(margin).mean()

    def loss_from_logps(self, logps: torch.Tensor) -> torch.Tensor:
        return self._loss_from_sums(self.masked(logps).sum(dim=1))

    def prepare(self, sequence_logps: torch.Tensor) -> None:
        """dL/ds_i for every row, from pass 1's sums, and the loss itself."""
        sums = sequence_logps.detach().requires_grad_()
        with torch.enable_grad():
            loss = self._loss_from_sums(sums)
            (weights,) = torch.autograd.grad(loss, sums)
        self._loss, self._weights = loss.detach(), weights  # (,), (2P,)

    def loss_from_logps_chunk(self, logps: torch.Tensor, start: int, end: int) -> torch.Tensor:
        # d/dlogp[b, t] of this surrogate = dL/ds_b: exactly the loss's gradient through the chunk
        return (logps.sum(dim=1) * self._weights.to(logps.dtype)).sum()

    def streamed_loss(self, chunk_total: torch.Tensor) -> torch.Tensor:
        return self._loss.to(chunk_total.dtype)
