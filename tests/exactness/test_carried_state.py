"""Hybrid models whose layers carry a state instead of attending (core/carried_state.py): Qwen3.5
and Qwen3-Next's GatedDeltaNet, Nemotron-H's and Granite-4's Mamba-2. StreamBP carries the conv
tail and the recurrent state from chunk to chunk, forward and backward: loss and every gradient
equal standard BP's in fp64; without the carry, or without its gradient, they do not."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from sbpbench.core import SequenceParallel, StreamConfig, UnsupportedModelError, carried_state, stream_backward
from sbpbench.core.architecture.small_copy import small_config
from sbpbench.data import make_batch
from sbpbench.methods import MethodSettings
from sbpbench.methods.exactness import compare_methods
from sbpbench.models import apply_lora, implementations

from ..conftest import left_padded_batch, padded_batch

HYBRIDS = {
    "qwen3_5_text": {},  # GatedDeltaNet layers, then a gated full-attention layer
    "qwen3_5_moe_text": {},
    "qwen3_next": {},
    "nemotron_h": {},  # Mamba-2 blocks, attention blocks, MLP blocks
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2},
}


def _hybrid(model_type: str, **overrides) -> torch.nn.Module:
    """The model type's small copy (the self-check's config), random weights, float64, training mode."""
    config = small_config(AutoConfig.for_model(model_type, **{**HYBRIDS[model_type], **overrides}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, **implementations(config, torch.float64))
    return model.to(torch.float64).train()  # modules a class keeps in float32 too: Float64Throughout needs all


def _assert_exact(model, batch, **settings):
    settings = MethodSettings(**{"chunk_size": 6, "logits_chunk_size": 7, **settings})
    (result,) = compare_methods(model, batch, ["streambp"], settings)
    assert result.ok, "\n".join(d.describe() for d in result.failures())


# Mamba-2's pure-torch scan takes over 10 s on 2 cores: the slow tier runs Nemotron-H.
SLOW_HYBRIDS = {"nemotron_h"}


@pytest.mark.parametrize(
    "model_type", [pytest.param(t, marks=pytest.mark.slow) if t in SLOW_HYBRIDS else t for t in HYBRIDS]
)
def test_a_hybrid_streams_exactly(model_type):
    """fp64, two rows (one right-padded), chunks that do not divide T: every gradient equals bp's."""
    model = _hybrid(model_type)
    _assert_exact(model, padded_batch(model, batch_size=2, seq_len=23, lengths=[23, 17]))


@pytest.mark.parametrize("objective", ["grpo", "dpo"])
def test_a_hybrid_streams_other_objectives_exactly(objective):
    """GRPO and DPO on Qwen3.5's GatedDeltaNet layers."""
    model = _hybrid("qwen3_5_text")
    _assert_exact(
        model, make_batch(objective, batch_size=2, seq_len=21, vocab_size=model.config.vocab_size, prompt_len=6)
    )


@pytest.mark.parametrize("checkpoints", ["cpu", "stream", "recompute:2"])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_a_hybrid_in_every_placement_and_chunk_size(checkpoints, chunk_size):
    """Chunks of one position, chunks that do not divide T, one chunk; rebuilt and streamed inputs."""
    model = _hybrid("qwen3_next")
    _assert_exact(model, padded_batch(model, batch_size=1, seq_len=13), checkpoints=checkpoints, chunk_size=chunk_size)


def test_a_hybrid_with_lora():
    """LoRA on every linear layer, the mixers' projections included."""
    model = apply_lora(_hybrid("qwen3_5_text"), rank=4, alpha=8, init_nonzero_seed=0)
    _assert_exact(model, padded_batch(model, batch_size=2, seq_len=19, lengths=[19, 12]))


def _grads(model, batch) -> dict:
    model.zero_grad(set_to_none=True)
    stream_backward(model, batch.input_ids, batch.labels, config=StreamConfig(chunk_size=5))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_dropping_the_state_carry_or_its_gradient_is_wrong(monkeypatch):
    """The comparison can fail: a chunk that starts from no state, or a backward that drops the
    gradient of the states a chunk leaves, gives other gradients."""
    model = _hybrid("qwen3_5_text")
    batch = padded_batch(model, batch_size=1, seq_len=17)
    right = _grads(model, batch)

    def differs(grads) -> bool:
        return any(not torch.allclose(grads[n], g, rtol=1e-8, atol=1e-12) for n, g in right.items())

    with monkeypatch.context() as patch:  # each chunk's start states forgotten in the backward
        patch.setattr(carried_state, "_leaf", lambda state: None)
        assert differs(_grads(model, batch))
    with monkeypatch.context() as patch:  # the states' gradient not handed to the chunk before
        patch.setattr(carried_state, "_leaf", lambda state: None if state is None else state.detach())
        assert differs(_grads(model, batch))


def test_left_padding_and_sequence_parallelism_are_refused_with_a_reason():
    """A carried state over left-padded rows, or across ranks, is refused in one line before any work."""
    model = _hybrid("qwen3_5_text")
    batch = left_padded_batch(model, seq_len=12, spans=[(3, 12), (0, 12)])
    with pytest.raises(UnsupportedModelError, match="left padding and packed rows are not supported"):
        stream_backward(model, batch.input_ids, batch.labels, attention_mask=batch.attention_mask)
    group = SequenceParallel.__new__(SequenceParallel)  # never used: the refusal comes first
    with pytest.raises(UnsupportedModelError, match="does not carry a linear-attention or SSM state from rank"):
        stream_backward(model, batch.input_ids, batch.labels, sequence_parallel=group)
