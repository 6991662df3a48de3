"""Every TRL option of the GRPO and DPO objectives (core/objectives/), streamed, equals the same
objective on transformers' full logits (bp), fp64, on TRL's batch layouts: GRPO's left-padded
prompts and right-padded completions, DPO's chosen rows then rejected rows. That the formulas are
TRL's own is tests/exactness/test_trl_losses.py's job."""

from __future__ import annotations

import pytest
import torch

from sbpbench.core import DPO, GRPO, SFT
from sbpbench.core.labels import shift_labels
from sbpbench.core.objectives import DPO_LOSS_TYPES, token_logps
from sbpbench.methods import MethodSettings
from sbpbench.methods.exactness import compare_methods

from ..conftest import ObjectiveBatch, grpo_rows, padded_batch, streamed, tiny_model

SETTINGS = MethodSettings(chunk_size=5, logits_chunk_size=7)  # neither divides T
PROMPTS, COMPLETIONS = [9, 4, 6, 9], [12, 15, 3, 8]  # TRL layout: prompt width 9, completion width 15


def assert_streamed_is_bp(model, batch):
    for result in compare_methods(model, batch, ["streambp"], SETTINGS):
        assert result.ok, "streambp differs from bp:\n" + "\n".join(d.describe() for d in result.failures())


def grpo_batch(model, *, completions=COMPLETIONS, off_policy=True, temperature=1.0, **options) -> ObjectiveBatch:
    """TRL's GRPO layout with advantages, reference log-probs, and old log-probs = current + noise
    (large enough that ratios leave the clip range)."""
    ids, mask, labels = grpo_rows(
        model, prompt_lengths=PROMPTS, completion_lengths=completions, prompt_width=9, completion_width=15
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        current = token_logps(model(input_ids=ids, attention_mask=mask).logits, shift_labels(labels), temperature)
    noise = lambda: 0.3 * torch.randn(current.shape, generator=generator, dtype=current.dtype)
    old, ref = (current + noise() if off_policy else None), current + noise()
    advantages = torch.randn(len(PROMPTS), generator=generator, dtype=torch.float64)
    make = lambda: GRPO(labels, advantages=advantages, ref_logps=ref, old_logps=old, temperature=temperature, **options)
    return ObjectiveBatch(ids, mask, labels, make)


GRPO_OPTIONS = {
    "defaults": {},
    "trl-defaults": {"beta": 0.0, "loss_type": "dapo", "use_bias_correction_kl": True},
    "bias-kl-clip-higher-delta": {"use_bias_correction_kl": True, "epsilon_high": 0.28, "delta": 1.3},
    "bnpo-ga2": {"loss_type": "bnpo", "gradient_accumulation_steps": 2},
    "dr_grpo": {"loss_type": "dr_grpo", "max_completion_length": 15},
    "dapo-window": {"loss_type": "dapo", "num_items_in_batch": 90, "gradient_accumulation_steps": 2},
}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("options", GRPO_OPTIONS)
def test_grpo_options_exact(options, level):
    """GRPO per loss_type, bias-corrected KL, clip-higher, delta, accumulation, token and sequence (GSPO) level."""
    model = tiny_model("tiny/qwen3")
    batch = grpo_batch(model, importance_sampling_level=level, **GRPO_OPTIONS[options])
    assert_streamed_is_bp(model, batch)


@pytest.mark.parametrize("family", ["tiny/llama", "tiny/gemma3"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_grpo_temperature_on_policy_and_an_empty_completion(family, level):
    """Temperature 0.7, on-policy (old = current), one row without completion tokens (adds 0, as in TRL)."""
    model = tiny_model(family)
    batch = grpo_batch(
        model,
        completions=[12, 0, 3, 8],
        off_policy=False,
        temperature=0.7,
        importance_sampling_level=level,
        use_bias_correction_kl=True,
    )
    assert_streamed_is_bp(model, batch)


def dpo_batch(model, *, empty_rejected=False, **options) -> ObjectiveBatch:
    """Two pairs (rows: chosen 0, chosen 1, rejected 0, rejected 1), right-padded as TRL pads them."""
    batch = padded_batch(model, batch_size=4, seq_len=21, lengths=[21, 16, 19, 9 if empty_rejected else 13])
    labels = batch.labels.clone()
    labels[:, :9] = -100  # the prompt
    ref = -6.0 * torch.rand(4, generator=torch.Generator().manual_seed(2), dtype=torch.float64) - 20.0
    return ObjectiveBatch(batch.input_ids, batch.attention_mask, labels, lambda: DPO(labels, ref_logps=ref, **options))


DPO_OPTIONS = {
    **{name: {"loss_type": name, "label_smoothing": 0.1} for name in DPO_LOSS_TYPES},
    "forward_kl": {"f_divergence_type": "forward_kl", "beta": 0.05},
    "js_divergence": {"f_divergence_type": "js_divergence"},
    "sigmoid+sft-ga2": {"loss_type": ("sigmoid", "sft"), "loss_weights": (1.0, 0.3), "gradient_accumulation_steps": 2},
}


@pytest.mark.parametrize("options", DPO_OPTIONS)
def test_dpo_loss_types_exact(options):
    """Every DPO loss type TRL 1.16 computes from sequence sums, the f-divergences, weighted combinations."""
    model = tiny_model("tiny/mistral")
    assert_streamed_is_bp(model, dpo_batch(model, **DPO_OPTIONS[options]))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_empty_rejected_response(loss_type):
    """A rejected response without counted tokens has sum 0 (TRL's term), not an error."""
    model = tiny_model("tiny/mistral")
    assert_streamed_is_bp(model, dpo_batch(model, empty_rejected=True, loss_type=loss_type))


def test_sft_num_items_in_batch_scales_and_allows_an_empty_micro_batch():
    """SFT divides by num_items_in_batch (the Trainer's window count), and a micro-batch with nothing
    to predict then gives loss 0 and zero gradients instead of an error."""
    model = tiny_model("tiny/qwen3")
    batch = padded_batch(model, batch_size=2, seq_len=17, lengths=[17, 12])
    assert_streamed_is_bp(
        model, ObjectiveBatch(**_fields(batch), make=lambda: SFT(batch.labels, num_items_in_batch=50))
    )
    model.zero_grad(set_to_none=True)
    empty = torch.full_like(batch.labels, -100)
    loss = streamed(model, batch.input_ids, objective=SFT(empty, num_items_in_batch=50), chunk_size=5)
    assert float(loss) == 0.0
    assert all(p.grad is None or not bool(p.grad.any()) for p in model.parameters())


def _fields(batch) -> dict:
    return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "labels": batch.labels}
