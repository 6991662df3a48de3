"""Synthetic batches follow the paper's recipe and are reproducible."""

from __future__ import annotations

import math

import pytest
import torch

from sbpbench.data import make_sft_batch


@pytest.mark.parametrize("seq_len", [10, 37, 9000])
def test_random_right_padding_in_paper_range(seq_len):
    """Each row is right-padded by a length in [1, 0.2*T); labels are -100 exactly on padding."""
    batch = make_sft_batch(batch_size=16, seq_len=seq_len, vocab_size=1000, seed=3)
    pad = seq_len - batch.attention_mask.sum(1)
    assert int(pad.min()) >= 1 and int(pad.max()) < math.ceil(0.2 * seq_len)
    mask = batch.attention_mask.bool()
    assert not (mask[:, 1:] & ~mask[:, :-1]).any()  # right padding only
    assert torch.equal(batch.labels == -100, ~mask)
    assert torch.equal(batch.labels[mask], batch.input_ids[mask])


def test_short_sequences_are_not_padded():
    """When [1, 0.2*T) holds no integer (T <= 5) the rows are full."""
    batch = make_sft_batch(batch_size=4, seq_len=5, vocab_size=50)
    assert bool(batch.attention_mask.all())


def test_seeded():
    """Same seed, same batch; another seed, another batch."""
    a, b, c = (make_sft_batch(batch_size=2, seq_len=64, vocab_size=500, seed=s) for s in (1, 1, 2))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.attention_mask, b.attention_mask)
    assert not torch.equal(a.input_ids, c.input_ids)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match=">= 1"):
        make_sft_batch(batch_size=0, seq_len=8, vocab_size=10)
