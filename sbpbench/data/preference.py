"""Synthetic GRPO and DPO batches: what a BP benchmark needs of RL and preference training.

No generation or reward model runs in a backpropagation benchmark (the paper's own GRPO and DPO
runs feed random tokens too), so the inputs that would come from them are seeded stand-ins with
realistic shapes and magnitudes:
- token ids uniform over the vocabulary; prompts shared within a GRPO group / a DPO pair;
- responses right-padded by the paper's random length in [1, 0.2 * response) (data/sft.py);
- per-token reference log-probs near -log(V) (what a randomly initialised model gives), so the
  KL terms and ratios stay in their usual range; the KL of a real run is small the same way;
- GRPO advantages: seeded N(0, 1) rewards normalised within the group, as GRPO does;
- DPO reference sequence log-probs: the sum of per-token values of the same kind.
Labels are -100 on the prompt and on padding: only response tokens count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core import DPO, GRPO, IGNORE_INDEX
from ..settings import SETTINGS
from .sft import TokenBatch, pad_lengths

DEFAULT_PROMPT_LEN: int = SETTINGS["prompt_len"].default  # the paper's GRPO and DPO prompt length
REF_LOGP_NOISE = 0.1  # std of the reference log-probs around -log(V)


def prompt_length(seq_len: int, prompt_len: int = DEFAULT_PROMPT_LEN) -> int:
    """The prompt takes prompt_len tokens, but never more than half a short sequence."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2 (a prompt token and a response token), got {seq_len}")
    return max(1, min(prompt_len, seq_len // 2))


def _prompt_and_responses(rows: int, seq_len: int, prompt_len: int, vocab_size: int, groups: int, generator):
    """(rows, T) ids and mask: `groups` distinct prompts, each shared by rows // groups rows."""
    ids = torch.randint(0, vocab_size, (rows, seq_len), generator=generator)
    prompts = torch.randint(0, vocab_size, (groups, prompt_len), generator=generator)
    ids[:, :prompt_len] = prompts.repeat_interleave(rows // groups, dim=0) if groups > 1 else prompts
    lengths = seq_len - pad_lengths(rows, seq_len - prompt_len, generator)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[:, :prompt_len] = IGNORE_INDEX
    return ids.masked_fill(mask == 0, 0), mask, labels


def _ref_token_logps(shape, vocab_size: int, generator) -> torch.Tensor:
    return -math.log(vocab_size) + REF_LOGP_NOISE * torch.randn(shape, generator=generator, dtype=torch.float64)


@dataclass(frozen=True)
class GRPOBatch(TokenBatch):
    input_ids: torch.Tensor  # (G, T): prompt then completion, right-padded
    attention_mask: torch.Tensor  # (G, T)
    labels: torch.Tensor  # (G, T): completion tokens, -100 on prompt and padding
    advantages: torch.Tensor  # (G,) float64
    ref_logps: torch.Tensor  # (G, T) float64, per target position (as labels shifted by one)
    old_logps: torch.Tensor | None = None  # None: on-policy (ratio 1)
    beta: float = 0.04
    epsilon: float = 0.2
    loss_type: str = "grpo"  # TRL's name for the normalisation (core/objectives/grpo.py)

    def objective(self) -> GRPO:
        return GRPO(
            self.labels,
            advantages=self.advantages,
            ref_logps=self.ref_logps,
            old_logps=self.old_logps,
            beta=self.beta,
            epsilon=self.epsilon,
            loss_type=self.loss_type,
        )


def make_grpo_batch(
    *,
    group_size: int,
    seq_len: int,
    vocab_size: int,
    prompt_len: int = DEFAULT_PROMPT_LEN,
    seed: int = 0,
    loss_type: str = "grpo",
    device: str | torch.device = "cpu",
) -> GRPOBatch:
    """One GRPO group: group_size completions of one prompt, seq_len tokens in all."""
    if group_size < 1:
        raise ValueError(f"grpo: the group needs at least one completion, got {group_size}")
    generator = torch.Generator().manual_seed(seed)
    prompt = prompt_length(seq_len, prompt_len)
    ids, mask, labels = _prompt_and_responses(group_size, seq_len, prompt, vocab_size, 1, generator)
    rewards = torch.randn(group_size, generator=generator, dtype=torch.float64)
    advantages = rewards - rewards.mean()
    if group_size > 1:
        advantages = advantages / (rewards.std() + 1e-4)  # GRPO's group normalisation
    ref = _ref_token_logps((group_size, seq_len), vocab_size, generator)
    batch = GRPOBatch(ids, mask, labels, advantages, ref, loss_type=loss_type)
    return batch.to(device)


@dataclass(frozen=True)
class DPOBatch(TokenBatch):
    input_ids: torch.Tensor  # (2P, T): P chosen rows, then the P rejected rows of the same prompts
    attention_mask: torch.Tensor
    labels: torch.Tensor  # response tokens only
    ref_logps: torch.Tensor  # (2P,) float64 reference sequence log-probs
    beta: float = 0.1

    def objective(self) -> DPO:
        return DPO(self.labels, ref_logps=self.ref_logps, beta=self.beta)


def make_dpo_batch(
    *,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    prompt_len: int = DEFAULT_PROMPT_LEN,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> DPOBatch:
    """batch_size rows = batch_size // 2 (chosen, rejected) pairs, seq_len tokens each."""
    if batch_size < 2 or batch_size % 2:
        raise ValueError(f"dpo: --batch counts rows, chosen + rejected: give an even number >= 2, got {batch_size}")
    generator = torch.Generator().manual_seed(seed)
    prompt = prompt_length(seq_len, prompt_len)
    pairs = batch_size // 2
    ids, mask, labels = _prompt_and_responses(batch_size, seq_len, prompt, vocab_size, pairs, generator)
    # rows [0, P) chosen and [P, 2P) rejected share prompts pairwise: reorder the interleaved groups
    order = torch.cat([torch.arange(0, batch_size, 2), torch.arange(1, batch_size, 2)])
    ids, mask, labels = ids[order], mask[order], labels[order]
    per_token = _ref_token_logps((batch_size, seq_len), vocab_size, generator)
    counted = labels[:, 1:] != IGNORE_INDEX  # target positions 0..T-2
    ref = (per_token[:, :-1] * counted).sum(dim=1)
    return DPOBatch(ids, mask, labels, ref).to(device)
