"""Synthetic batches shaped like the StreamBP paper's (appendix D).

Random token ids; each row right-padded by a random length in [1, 0.2 * T) (no padding when that
range is empty, T <= 5); labels equal the ids on real tokens and -100 on padding. Seeded, and
generated on the CPU so the same seed gives the same batch on every device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from ..core import IGNORE_INDEX, SFT


class TokenBatch:
    """What every batch dataclass shares: input_ids, attention_mask and labels (B, T), plus
    whatever tensors its objective needs; .objective() builds that objective from them."""

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device):
        """The same batch with every tensor field on `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device) for f in fields(self) if torch.is_tensor(getattr(self, f.name))
        }
        return replace(self, **moved)


@dataclass(frozen=True)
class SFTBatch(TokenBatch):
    input_ids: torch.Tensor  # (B, T) int64
    attention_mask: torch.Tensor  # (B, T) int64, 1 real, 0 padding
    labels: torch.Tensor  # (B, T) int64, -100 on padding

    def objective(self) -> SFT:
        return SFT(self.labels)


def pad_lengths(batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """Per-row padding length, uniform over the integers in [1, 0.2 * T)."""
    high = math.ceil(0.2 * seq_len)  # exclusive upper bound
    if high <= 1:
        return torch.zeros(batch_size, dtype=torch.long)
    return torch.randint(1, high, (batch_size,), generator=generator)


def make_sft_batch(
    *,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    seed: int = 0,
    padding: bool = True,
    pad_token_id: int = 0,
    device: str | torch.device = "cpu",
) -> SFTBatch:
    if batch_size < 1 or seq_len < 1 or vocab_size < 1:
        raise ValueError(f"batch_size, seq_len and vocab_size must be >= 1, got {batch_size}, {seq_len}, {vocab_size}")
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    if padding:
        lengths = seq_len - pad_lengths(batch_size, seq_len, generator)
        attention_mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    input_ids = input_ids.masked_fill(attention_mask == 0, pad_token_id)
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return SFTBatch(input_ids, attention_mask, labels).to(device)
