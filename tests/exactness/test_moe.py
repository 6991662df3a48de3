"""Mixture-of-experts models with their load-balancing loss on (core/objectives/router_loss.py):
StreamBP gives the model's own loss (objective + coef x aux) and every gradient in fp64, for every
MoE family, objective, padded rows, LoRA on the experts' projections and the placements; HF's
loss function applied chunk by chunk would not."""

from __future__ import annotations

import sys

import pytest
import torch

from sbpbench.core import StreamConfig, stream_backward
from sbpbench.data import make_batch
from sbpbench.methods import MethodSettings
from sbpbench.methods.exactness import compare_methods
from sbpbench.models import apply_lora

from ..conftest import padded_batch, tiny_model

MOE_FAMILIES = ("tiny/qwen3-moe", "tiny/mixtral", "tiny/gpt-oss", "tiny/llama4")
COEF = 0.3  # large, so that a wrong balance term cannot hide in rounding


def _moe(family: str, **overrides):
    model = tiny_model(family, output_router_logits=True, router_aux_loss_coef=COEF, **overrides)
    model.train()
    return model


def _assert_exact(model, batch, **settings):
    (result,) = compare_methods(
        model, batch, ["streambp"], MethodSettings(chunk_size=5, logits_chunk_size=7, **settings)
    )
    assert result.ok, "\n".join(d.describe() for d in result.failures())


@pytest.mark.parametrize("objective", ["sft", "grpo", "dpo"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_balance_loss_streams_exactly(family, objective):
    """fp64, right-padded rows: loss and every gradient equal bp's (objective + coef x aux)."""
    model = _moe(family)
    if objective == "sft":
        batch = padded_batch(model, batch_size=2, seq_len=23, lengths=[23, 17])
    else:
        batch = make_batch(objective, batch_size=2, seq_len=21, vocab_size=model.config.vocab_size, prompt_len=6)
    _assert_exact(model, batch)


@pytest.mark.parametrize("checkpoints", ["cpu", "stream", "recompute:2"])
def test_the_balance_loss_in_every_placement(checkpoints):
    """The counts come from the checkpoint pass alone: rebuilds (recompute, stream) add none."""
    model = _moe("tiny/qwen3-moe", num_hidden_layers=3)
    _assert_exact(model, padded_batch(model, batch_size=2, seq_len=19, lengths=[19, 12]), checkpoints=checkpoints)


def test_the_balance_loss_with_lora_on_the_experts():
    """LoRA on every linear layer (the routers' and attention's; peft wraps nn.Linear): exact."""
    model = apply_lora(_moe("tiny/mixtral"), rank=4, alpha=8, init_nonzero_seed=0)
    _assert_exact(model, padded_batch(model, batch_size=2, seq_len=19, lengths=[19, 12]))


def test_the_balance_term_changes_the_loss_and_the_coefficient_overrides_it():
    """With the term, the loss exceeds the objective alone by coef x aux; router_aux_loss_coef=0 turns it
    off and another coefficient scales it, as TRL's trainers pass theirs."""
    model = _moe("tiny/qwen3-moe")
    batch = padded_batch(model, batch_size=2, seq_len=19, lengths=[19, 12])
    config = StreamConfig(chunk_size=5)

    def loss(**kwargs):
        model.zero_grad(set_to_none=True)
        return float(
            stream_backward(
                model, batch.input_ids, batch.labels, attention_mask=batch.attention_mask, config=config, **kwargs
            )
        )

    with_term, without, doubled = loss(), loss(router_aux_loss_coef=0), loss(router_aux_loss_coef=2 * COEF)
    assert with_term > without
    assert doubled - without == pytest.approx(2 * (with_term - without), rel=1e-12)


def test_the_loss_function_applied_per_chunk_differs():
    """HF's load_balancing_loss_func on each chunk's router logits, summed or averaged, is not the
    whole batch's: the counts and means pool over every position."""
    model = _moe("tiny/qwen3-moe")
    batch = padded_batch(model, batch_size=2, seq_len=24, lengths=[24, 24])
    loss_func = sys.modules[type(model).__module__].load_balancing_loss_func
    with torch.no_grad():
        output = model(input_ids=batch.input_ids, use_cache=False)
    E, k = model.num_experts, model.num_experts_per_tok
    whole = float(loss_func(output.router_logits, E, k))
    chunks = []
    for start in range(0, 24, 6):  # router logits are (B x T, E) per layer: rows b * T + t
        rows = torch.cat([torch.arange(b * 24 + start, b * 24 + start + 6) for b in range(2)])
        chunks.append(float(loss_func(tuple(z[rows] for z in output.router_logits), E, k)))
    assert abs(sum(chunks) / len(chunks) - whole) > 1e-6 * whole
    assert abs(sum(chunks) - whole) > 1e-6 * whole
