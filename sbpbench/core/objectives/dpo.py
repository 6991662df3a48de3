"""DPO (Rafailov et al., arXiv 2305.18290) and the other preference losses of TRL's DPOTrainer
(TRL 1.16 `DPOTrainer._compute_loss`) whose inputs are the sequence log-prob sums, each named as
TRL names it.

Rows [0, P) are the chosen responses and rows [P, 2P) the rejected ones of the same P prompts
(TRL's concatenated layout); labels are -100 on the prompt and padding. With s the response's
summed token log-probs under the policy and r the reference's:
    logratio  = s - r                         per row
    score     = logratio (f_divergence_type "reverse_kl"), 1 - exp(-logratio) ("forward_kl"),
                log 2 + log sigmoid(logratio) ("js_divergence")
    delta     = score_chosen - score_rejected  per pair
    loss      = sum over loss_type of loss_weight x mean over pairs of the type's loss, / GA
Every supported type is a function of the sums (and of fixed token counts), so it streams in two
passes (base.SequenceSumsObjective). A response without counted tokens has s = 0, as in TRL.
Not supported, and refused by the trainer integration: `ld_alpha` (length-desensitised sums),
`use_weighting` (WPO weights from the full distribution), f_divergence_type "alpha_divergence".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..labels import IGNORE_INDEX
from .base import SequenceSumsObjective

DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence")


@dataclass(eq=False)
class DPO(SequenceSumsObjective):
    """ref_logps (2P,): the reference model's sequence log-probs in the same row order, computed
    beforehand (a frozen reference model, or the LoRA model with adapters disabled). loss_type: one
    of DPO_LOSS_TYPES or a tuple of them, weighted by loss_weights (TRL's default: 1 each).
    label_smoothing: exo_pair, robust, aot, aot_unpaired. gradient_accumulation_steps: the
    Trainer divides DPO's loss by it (its batches carry no labels)."""

    ref_logps: torch.Tensor = None
    beta: float = 0.1
    loss_type: str | tuple[str, ...] = "sigmoid"
    loss_weights: tuple[float, ...] | None = None
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    discopop_tau: float = 0.05
    gradient_accumulation_steps: int = 1
    name = "dpo"
    packing_refused = "DPO's sequence sums are per row, not per packed document"

    def __post_init__(self):
        super().__post_init__()
        rows = self.labels.shape[0]
        if rows % 2:
            raise ValueError(f"dpo: needs (chosen, rejected) pairs: an even number of rows, got {rows}")
        if self.ref_logps is None or self.ref_logps.shape != (rows,):
            raise ValueError(f"dpo: ref_logps must be one per row, shape ({rows},)")
        self.loss_types = (self.loss_type,) if isinstance(self.loss_type, str) else tuple(self.loss_type)
        unknown = [name for name in self.loss_types if name not in DPO_LOSS_TYPES]
        if unknown or not self.loss_types:
            raise ValueError(
                f"dpo: loss_type {unknown or self.loss_type!r} is not supported; StreamBP takes TRL's "
                f"{', '.join(DPO_LOSS_TYPES)} (each a function of the sequence log-prob sums)"
            )
        weights = self.loss_weights if self.loss_weights is not None else (1.0,) * len(self.loss_types)
        if len(weights) != len(self.loss_types):
            raise ValueError(f"dpo: {len(weights)} loss_weights for {len(self.loss_types)} loss types")
        self.type_weights = tuple(weights)
        if self.f_divergence_type not in F_DIVERGENCE_TYPES:
            raise ValueError(
                f"dpo: f_divergence_type {self.f_divergence_type!r} is not supported; "
                f"StreamBP takes {', '.join(F_DIVERGENCE_TYPES)}"
            )
        # completion tokens per row as TRL counts them (its completion_mask: labels != -100, position 0
        # included) for ipo / sigmoid_norm; the chosen rows' counted targets for "sft"
        self.completion_tokens = (self.labels != IGNORE_INDEX).sum(dim=1).to(torch.float64)
        self.chosen_targets = int(self.mask[: rows // 2].sum())

    def token_values(self, logps: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return self.masked(logps, start)[..., None]  # (B, c, 1): the sums are the sequence log-probs

    def loss_from_sums(self, sums: torch.Tensor) -> torch.Tensor:
        logps = sums[:, 0]
        pairs = logps.shape[0] // 2
        logratios = logps - self.ref_logps.to(logps.dtype)
        scores = self._scores(logratios)
        context = _Pair(
            logps[:pairs], logps[pairs:], logratios[:pairs], logratios[pairs:], scores[:pairs] - scores[pairs:]
        )
        loss = 0.0
        for name, weight in zip(self.loss_types, self.type_weights):
            loss = loss + self._per_pair_loss(name, context, scores).mean() * weight
        return loss / self.gradient_accumulation_steps

    def _scores(self, logratios: torch.Tensor) -> torch.Tensor:
        if self.f_divergence_type == "forward_kl":  # f'(t) = 1 - 1/t
            return 1 - torch.exp(-logratios)
        if self.f_divergence_type == "js_divergence":  # f'(t) = log(2t / (t + 1))
            return math.log(2) + F.logsigmoid(logratios)
        return logratios

    def _per_pair_loss(self, name: str, pair: _Pair, scores: torch.Tensor) -> torch.Tensor:
        """TRL 1.16's per-sequence loss of one loss type, in its order of operations."""
        beta, smoothing, delta = self.beta, self.label_smoothing, pair.delta
        if name == "sigmoid":
            return -F.logsigmoid(beta * delta)
        if name == "hinge":
            return torch.relu(1 - beta * delta)
        if name in ("ipo", "sigmoid_norm"):
            pairs = delta.shape[0]
            counts = self.completion_tokens.to(delta.dtype).clamp(min=1.0)
            average = scores[:pairs] / counts[:pairs] - scores[pairs:] / counts[pairs:]
            return (average - 1 / (2 * beta)) ** 2 if name == "ipo" else -F.logsigmoid(beta * average)
        if name == "exo_pair":
            # in torch's default dtype, as TRL makes it: its log terms are float32 constants in any model
            epsilon = torch.tensor(smoothing, device=delta.device)
            chosen = torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - torch.log1p(-epsilon))
            return chosen + torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - torch.log(epsilon))
        if name == "nca_pair":
            chosen, rejected = beta * pair.chosen_logratios, beta * pair.rejected_logratios
            return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)
        if name == "robust":
            clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
            return (clean - -smoothing * F.logsigmoid(-beta * delta)) / (1 - 2 * smoothing)
        if name == "bco_pair":
            return -F.logsigmoid(beta * pair.chosen_logratios) - F.logsigmoid(-beta * pair.rejected_logratios)
        if name == "sppo_hard":
            return (pair.chosen_logratios - 0.5 / beta) ** 2 + (pair.rejected_logratios + 0.5 / beta) ** 2
        if name in ("aot", "aot_unpaired"):
            if name == "aot":  # the policy's chosen - rejected log-probs against the reference's, each sorted
                ref = self.ref_logps.to(delta.dtype)
                first, second = pair.chosen_logps - pair.rejected_logps, ref[: delta.shape[0]] - ref[delta.shape[0] :]
            else:
                first, second = pair.chosen_logratios, pair.rejected_logratios
            sorted_delta = torch.sort(first, dim=0)[0] - torch.sort(second, dim=0)[0]
            return -F.logsigmoid(beta * sorted_delta) * (1 - smoothing) - F.logsigmoid(-beta * sorted_delta) * smoothing
        if name == "apo_zero":
            return (1 - torch.sigmoid(beta * pair.chosen_logratios)) + torch.sigmoid(beta * pair.rejected_logratios)
        if name == "apo_down":
            chosen = pair.chosen_logratios
            return torch.sigmoid(beta * chosen) + (1 - torch.sigmoid(beta * (chosen - pair.rejected_logratios)))
        if name == "discopop":
            logits = delta * beta
            modulation = torch.sigmoid(logits / self.discopop_tau)
            return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
        assert name == "sft", name
        # -mean of the chosen rows' counted token log-probs, the same for every pair
        return (-pair.chosen_logps.sum() / self.chosen_targets).expand(delta.shape[0])


@dataclass(frozen=True)
class _Pair:
    """Per pair (P,): the inputs TRL's loss types read."""

    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    chosen_logratios: torch.Tensor
    rejected_logratios: torch.Tensor
    delta: torch.Tensor  # score_chosen - score_rejected
