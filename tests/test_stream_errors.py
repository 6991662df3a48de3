"""Inputs StreamBP cannot handle exactly are refused with a clear message, never approximated."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from sbpbench.core import UnsupportedModelError, stream_backward

from .conftest import padded_batch, tiny_model


def test_left_padding_is_refused():
    """A 0 before a 1 in attention_mask (left padding, packing) is refused."""
    model = tiny_model("tiny/qwen3")
    batch = padded_batch(model, batch_size=2, seq_len=8)
    mask = batch.attention_mask.clone()
    mask[1, :3] = 0
    with pytest.raises(ValueError, match="right padding only"):
        stream_backward(model, batch.input_ids, batch.labels, attention_mask=mask)


def test_counted_label_after_padding_is_refused():
    """A padded position that would predict a counted label is refused."""
    model = tiny_model("tiny/qwen3")
    batch = padded_batch(model, batch_size=2, seq_len=8, lengths=[8, 4])
    with pytest.raises(ValueError, match="-100 after padding"):
        stream_backward(model, batch.input_ids, batch.input_ids, attention_mask=batch.attention_mask)


@pytest.mark.parametrize("kwargs", [{"chunk_size": 0}, {"logits_chunk_size": -3}, {"chunk_size": 2.5}])
def test_bad_chunk_sizes_are_refused(kwargs):
    """Chunk sizes must be positive integers."""
    model = tiny_model("tiny/qwen3")
    batch = padded_batch(model, batch_size=1, seq_len=8)
    with pytest.raises(ValueError, match="positive integer"):
        stream_backward(model, batch.input_ids, batch.labels, **kwargs)


def test_unsupported_family_is_refused_with_the_supported_list():
    """A GPT-2 model is refused and the message lists the supported families."""
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    ids = torch.randint(0, 64, (1, 8))
    with pytest.raises(UnsupportedModelError, match="Qwen3.*Llama|Llama.*Qwen3"):
        stream_backward(model, ids, ids)


def test_attention_dropout_in_training_is_refused():
    """Dropout would make each chunk's re-forward differ from the checkpoint pass."""
    model = tiny_model("tiny/llama", attention_dropout=0.1)
    model.train()
    batch = padded_batch(model, batch_size=1, seq_len=8)
    with pytest.raises(UnsupportedModelError, match="attention_dropout"):
        stream_backward(model, batch.input_ids, batch.labels)
    model.eval()
    stream_backward(model, batch.input_ids, batch.labels)  # eval mode: no dropout, accepted
