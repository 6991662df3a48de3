"""GRPO (DeepSeekMath, arXiv 2402.03300, eq. 3-4) with the options of TRL's GRPOTrainer that change
gradients, named as TRL 1.16 names them (`GRPOTrainer._compute_loss`, `GRPOConfig`).

Per counted token (completion tokens only; prompt and padding labels are -100), to be minimised:
    log_w  = logp - old_logp                        importance_sampling_level "token"
           = mean over the row's tokens of that     "sequence" (GSPO, arXiv 2507.18071)
    coef   = exp(log_w)
    pg     = -min(min(coef, delta) x A, clip(coef, 1 - epsilon, 1 + epsilon_high) x A)   (delta: two-sided clipping)
    kl     = exp(ref - logp) - (ref - logp) - 1     (k3), times coef if use_bias_correction_kl
    term   = pg + beta x kl
summed with weights per loss_type (n_b: the row's tokens, N: the batch's, B rows, GA the
accumulation steps):
    grpo     sum_t term / max(n_b, 1), mean over rows, / GA
    bnpo     sum term / max(N, 1) / GA
    dr_grpo  sum term / (B x max_completion_length) / GA
    dapo     sum term / (max(num_items_in_batch, 1) / num_processes x GA / steps_per_generation)
A row without completion tokens adds 0, as in TRL. The token level is per-token independent and
chunks directly; the sequence level is a function of per-row sums (the log-ratio, and the weighted
KL), streamed in two passes (base.SequenceSumsObjective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import SequenceSumsObjective

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass(eq=False)
class GRPO(SequenceSumsObjective):
    """advantages (B,): one per row (a group's rows share a prompt). old_logps / ref_logps (B, T):
    per target position, as `targets`. old_logps None means on-policy (TRL's default of one
    optimisation step per generation): old = the current log-probs, detached, so the ratio is 1.
    temperature: the logits are divided by it before the log-softmax (the same temperature as the
    one old_logps and ref_logps were computed with). Defaults are this project's documented ones
    (beta 0.04, loss_type "grpo", no bias-corrected KL); TRL 1.16's are beta 0.0, loss_type
    "dapo", use_bias_correction_kl True."""

    advantages: torch.Tensor = None
    ref_logps: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    beta: float = 0.04  # KL weight (DeepSeekMath)
    epsilon: float = 0.2  # TRL's epsilon (its epsilon_low)
    epsilon_high: float | None = None  # DAPO's clip-higher; None: = epsilon
    delta: float | None = None  # two-sided clipping: the unclipped ratio capped at delta
    loss_type: str = "grpo"
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = False
    temperature: float = 1.0
    max_completion_length: int | None = None  # dr_grpo's normaliser
    num_items_in_batch: int | float | None = None  # dapo: counted tokens of the generation batch; None: this batch's
    num_processes: int = 1  # dapo
    gradient_accumulation_steps: int = 1
    steps_per_generation: int | None = None  # dapo; None: = gradient_accumulation_steps (TRL's default)
    name = "grpo"
    packing_refused = "GRPO's advantages and normalisations are per row, not per packed document"

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
        if self.loss_type not in GRPO_LOSS_TYPES:
            raise ValueError(
                f"grpo: loss_type {self.loss_type!r} is not supported; StreamBP takes TRL's {', '.join(GRPO_LOSS_TYPES)}"
            )
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"grpo: importance_sampling_level must be one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}, "
                f"got {self.importance_sampling_level!r}"
            )
        if self.loss_type == "dr_grpo" and not (self.max_completion_length or 0) > 0:
            raise ValueError("grpo: loss_type 'dr_grpo' divides by max_completion_length; pass it (TRL's GRPOConfig)")
        if not self.temperature > 0:
            raise ValueError(f"grpo: temperature must be positive, got {self.temperature}")
        self.counts = self.mask.sum(dim=1).to(torch.float64)  # (B,) completion tokens per row
        normalizer = self._normalizer()
        per_row = torch.is_tensor(normalizer)
        self.weights = self.mask.to(torch.float64) / (normalizer[:, None] if per_row else normalizer)  # (B, T)
        self.row_weights = self.weights.sum(dim=1)  # (B,): what a per-row term is weighted by

    def _normalizer(self) -> torch.Tensor | float:
        """What each loss_type divides a row's (grpo: (B,)) or the batch's summed terms by."""
        steps, batch = self.gradient_accumulation_steps, self.labels.shape[0]
        if self.loss_type == "grpo":
            return self.counts.clamp(min=1.0) * batch * steps
        if self.loss_type == "bnpo":
            return float(max(self.num_targets, 1) * steps)
        if self.loss_type == "dr_grpo":
            return float(batch * self.max_completion_length * steps)
        items = self.num_targets if self.num_items_in_batch is None else float(self.num_items_in_batch)
        per_generation = self.steps_per_generation or steps
        return max(items, 1.0) / self.num_processes * steps / per_generation

    @property
    def needs_sequence_sums(self) -> bool:
        return self.importance_sampling_level == "sequence"

    def _log_ratio(self, logps: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """(B, c) logp - old_logp on counted positions, 0 elsewhere."""
        old = logps.detach() if self.old_logps is None else self.old_logps[:, start:end].to(logps.dtype)
        return torch.where(self.mask[:, start:end], logps - old, torch.zeros_like(logps))

    def _kl(self, logps: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """(B, c) k3 KL to the reference on counted positions, 0 elsewhere."""
        delta = self.ref_logps[:, start:end].to(logps.dtype) - logps
        return torch.where(self.mask[:, start:end], torch.exp(delta) - delta - 1, torch.zeros_like(logps))

    def _policy_term(self, coef: torch.Tensor) -> torch.Tensor:
        """-min(capped coef x A, clipped coef x A) for coef (B,) or (B, c), as TRL computes it."""
        advantages = self.advantages.to(coef.dtype)
        advantages = advantages if coef.dim() == 1 else advantages[:, None]
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        clipped = torch.clamp(coef, 1 - self.epsilon, 1 + high)
        capped = coef if self.delta is None else torch.clamp(coef, max=self.delta)
        return -torch.min(capped * advantages, clipped * advantages)

    def _token_terms(self, coef: torch.Tensor, logps: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """(B, c) per-token terms for importance weights coef ((B, c), or (B, 1) per sequence)."""
        terms = self._policy_term(coef)
        if self.beta != 0:
            kl = self._kl(logps, start, end)
            terms = terms + self.beta * (kl * coef if self.use_bias_correction_kl else kl)
        return terms

    def loss_from_logps(self, logps: torch.Tensor) -> torch.Tensor:
        """The loss from the whole (B, T) log-probs, written as TRL writes it (the reference)."""
        end = logps.shape[1]
        log_ratio = self._log_ratio(logps, 0, end)
        if self.needs_sequence_sums:
            log_ratio = log_ratio.sum(dim=1, keepdim=True) / self.counts.clamp(min=1.0).to(logps.dtype)[:, None]
        terms = self._token_terms(torch.exp(log_ratio), logps, 0, end)
        return (torch.where(self.mask, terms, torch.zeros_like(terms)) * self.weights.to(logps.dtype)).sum()

    def loss_from_logps_chunk(self, logps: torch.Tensor, start: int, end: int) -> torch.Tensor:
        if self.needs_sequence_sums:
            return super().loss_from_logps_chunk(logps, start, end)
        terms = self._token_terms(torch.exp(self._log_ratio(logps, start, end)), logps, start, end)
        mask, weights = self.mask[:, start:end], self.weights[:, start:end].to(logps.dtype)
        return (torch.where(mask, terms, torch.zeros_like(terms)) * weights).sum()

    def streamed_loss(self, chunk_total: torch.Tensor) -> torch.Tensor:
        return super().streamed_loss(chunk_total) if self.needs_sequence_sums else chunk_total

    # importance_sampling_level "sequence": sums S[:, 0] = the row's log-ratio, S[:, 1] = its weighted KL
    def token_values(self, logps: torch.Tensor, start: int, end: int) -> torch.Tensor:
        log_ratio = self._log_ratio(logps, start, end)
        kl = self._kl(logps, start, end) * self.weights[:, start:end].to(logps.dtype) if self.beta != 0 else None
        return torch.stack([log_ratio, torch.zeros_like(log_ratio) if kl is None else kl], dim=-1)

    def loss_from_sums(self, sums: torch.Tensor) -> torch.Tensor:
        coef = torch.exp(sums[:, 0] / self.counts.clamp(min=1.0).to(sums.dtype))  # (B,)
        loss = (self._policy_term(coef) * self.row_weights.to(sums.dtype)).sum()
        if self.beta != 0:
            kl = sums[:, 1] * coef if self.use_bias_correction_kl else sums[:, 1]
            loss = loss + self.beta * kl.sum()
        return loss
