"""GRPO and DPO: the objective values against direct formulas, and every method exact on them."""

from __future__ import annotations

import math

import pytest
import torch

from sbpbench.core import DPO, GRPO, SFT
from sbpbench.core.labels import shift_labels
from sbpbench.core.objectives import token_logps
from sbpbench.data import DPOBatch, GRPOBatch, make_dpo_batch, make_grpo_batch
from sbpbench.methods import MethodSettings
from sbpbench.methods.exactness import compare_methods

from ..conftest import streamed, tiny_model

SETTINGS = MethodSettings(chunk_size=5, logits_chunk_size=7)  # neither divides T
FAMILIES = ("tiny/qwen3", "tiny/llama", "tiny/mistral")  # qwen3 and llama tie embeddings; mistral does not


def _current_logps(model, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return token_logps(logits, batch.objective().targets)


def _off_policy(model, batch: GRPOBatch, seed: int = 1) -> GRPOBatch:
    """Old log-probs = the current ones plus noise large enough that some ratios leave [0.8, 1.2]."""
    current = _current_logps(model, batch)
    noise = 0.3 * torch.randn(current.shape, generator=torch.Generator().manual_seed(seed), dtype=current.dtype)
    return GRPOBatch(**{**batch.__dict__, "old_logps": current + noise})


def test_grpo_value_matches_the_deepseekmath_formula():
    """Per-sequence mean then batch mean (DeepSeekMath eq. 3 with k3 KL; TRL's "grpo") and the
    token-level mean (TRL's "bnpo" and, in one process, "dapo"), written as explicit loops."""
    torch.manual_seed(0)
    B, T = 3, 9
    labels = torch.randint(0, 50, (B, T))
    labels[:, :3] = -100
    labels[1, 7:] = -100
    logps, old, ref = (-torch.rand(B, T, dtype=torch.float64) * 3 for _ in range(3))
    adv = torch.tensor([1.5, -0.5, 0.2], dtype=torch.float64)
    beta, eps = 0.04, 0.2
    expected_seq, expected_tok, count = 0.0, 0.0, 0
    for b in range(B):
        terms = []
        for t in range(T - 1):
            if labels[b, t + 1] == -100:
                continue
            ratio = math.exp(logps[b, t] - old[b, t])
            pg = -min(ratio * adv[b], min(max(ratio, 1 - eps), 1 + eps) * adv[b])
            d = float(ref[b, t] - logps[b, t])
            terms.append(pg + beta * (math.exp(d) - d - 1))
        expected_seq += sum(terms) / len(terms) / B
        expected_tok += sum(terms)
        count += len(terms)
    for loss_type, expected in (("grpo", expected_seq), ("bnpo", expected_tok / count), ("dapo", expected_tok / count)):
        grpo = GRPO(labels, advantages=adv, ref_logps=ref, old_logps=old, beta=beta, loss_type=loss_type)
        assert float(grpo.loss_from_logps(logps)) == pytest.approx(float(expected), rel=1e-12)


def test_dpo_value_matches_the_sigmoid_formula():
    """-mean log sigmoid(beta * ((s_c - r_c) - (s_r - r_r))) over pairs (Rafailov et al. eq. 7)."""
    torch.manual_seed(0)
    labels = torch.randint(0, 50, (4, 6))
    labels[:, :2] = -100
    logps = -torch.rand(4, 6, dtype=torch.float64)
    ref = -torch.rand(4, dtype=torch.float64) * 5
    sums = [float(logps[b, :5][labels[b, 1:] != -100].sum()) for b in range(4)]
    beta = 0.1
    expected = sum(
        -math.log(1 / (1 + math.exp(-beta * ((sums[p] - ref[p]) - (sums[p + 2] - ref[p + 2]))))) for p in range(2)
    )
    loss = DPO(labels, ref_logps=ref, beta=beta).loss_from_logps(logps)
    assert float(loss) == pytest.approx(expected / 2, rel=1e-12)


def test_sft_objective_is_transformers_loss():
    """SFT.full_loss equals transformers' own `labels=` loss."""
    model = tiny_model("tiny/qwen3", torch.float32)
    ids = torch.randint(0, 512, (2, 11))
    out = model(input_ids=ids, labels=ids)
    assert torch.allclose(SFT(ids).full_loss(out.logits), out.loss, rtol=1e-6)


def _assert_exact(model, batch):
    for result in compare_methods(model, batch, ["ckpt", "streambp"], SETTINGS):
        assert result.ok, f"{result.method} differs from bp:\n" + "\n".join(d.describe() for d in result.failures())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_exact(family, dtype, loss_type):
    """GRPO, a group of 4 with uneven completion lengths, off-policy ratios (some clipped) and KL."""
    model = tiny_model(family, dtype)
    batch = make_grpo_batch(group_size=4, seq_len=33, vocab_size=512, prompt_len=6, loss_type=loss_type)
    batch = _off_policy(model, batch)
    clipped = (batch.old_logps - _current_logps(model, batch)).exp()
    assert bool(((clipped < 0.8) | (clipped > 1.2)).any())  # the clip is exercised
    _assert_exact(model, batch)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_grpo_on_policy_exact(dtype):
    """On-policy GRPO (old = current, ratio 1): the gradient is A times the log-prob gradient plus KL.

    Group-normalised advantages sum to zero, so the on-policy loss *value* is a cancellation of
    terms of size 1 down to ~1e-4, which a float32 relative comparison would measure instead of the
    method; shifted advantages keep the value well-conditioned (the gradients never cancel)."""
    model = tiny_model("tiny/qwen2", dtype)
    batch = make_grpo_batch(group_size=3, seq_len=25, vocab_size=512, prompt_len=4)
    batch = GRPOBatch(**{**batch.__dict__, "advantages": batch.advantages + 2.0})
    _assert_exact(model, batch)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("family", [*FAMILIES, "tiny/gemma3"])
def test_dpo_exact(family, dtype):
    """DPO, two pairs with different response lengths: the two-pass streamed head equals full logits."""
    model = tiny_model(family, dtype)
    batch = make_dpo_batch(batch_size=4, seq_len=31, vocab_size=512, prompt_len=7)
    _assert_exact(model, batch)


def test_dpo_streamed_loss_is_the_loss():
    """stream_backward returns DPO's loss itself (from pass 1), not the pass-2 surrogate."""
    model = tiny_model("tiny/llama", torch.float64)
    batch = make_dpo_batch(batch_size=2, seq_len=20, vocab_size=512, prompt_len=5)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected = batch.objective().full_loss(logits)
    model.zero_grad()
    loss = streamed(model, batch.input_ids, objective=batch.objective(), attention_mask=batch.attention_mask)
    assert torch.allclose(loss, expected.detach(), rtol=1e-12)


_LABELS = torch.ones(2, 4, dtype=torch.long)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: GRPO(torch.ones(2, 4, dtype=torch.long), advantages=torch.ones(3)), "advantages"),
        (lambda: GRPO(torch.ones(2, 4, dtype=torch.long), advantages=torch.ones(2)), "ref_logps"),
        (lambda: DPO(torch.ones(3, 4, dtype=torch.long), ref_logps=torch.ones(3)), "even number"),
        (lambda: make_dpo_batch(batch_size=3, seq_len=8, vocab_size=9), "even number"),
        (lambda: GRPO(_LABELS, advantages=torch.ones(2), beta=0, loss_type="cispo"), "loss_type 'cispo'"),
        (lambda: GRPO(_LABELS, advantages=torch.ones(2), beta=0, loss_type="dr_grpo"), "max_completion_length"),
        (lambda: GRPO(_LABELS, advantages=torch.ones(2), beta=0, importance_sampling_level="row"), "sampling_level"),
        (lambda: DPO(_LABELS, ref_logps=torch.ones(2), loss_type=("sigmoid", "kto")), "'kto'"),
        (lambda: DPO(_LABELS, ref_logps=torch.ones(2), f_divergence_type="alpha_divergence"), "alpha_divergence"),
        (lambda: DPO(_LABELS, ref_logps=torch.ones(2), loss_type=("sigmoid", "ipo"), loss_weights=(1.0,)), "weights"),
    ],
)
def test_bad_objective_inputs_say_what_is_wrong(make, message):
    """Malformed GRPO/DPO inputs, and TRL options StreamBP does not take, are ValueErrors naming them."""
    with pytest.raises(ValueError, match=message):
        make()


def test_stream_backward_needs_labels_or_objective():
    """stream_backward takes labels or an objective, exactly one of them."""
    model = tiny_model("tiny/qwen3", torch.float64)
    ids = torch.randint(0, 512, (1, 8))
    with pytest.raises(ValueError, match="either labels"):
        streamed(model, ids)
    with pytest.raises(ValueError, match="either labels"):
        streamed(model, ids, ids, objective=SFT(ids))


def _saturating_refs(sums: torch.Tensor, beta: float) -> torch.Tensor:
    """Reference log-probs that put pair 0 at margin +1e4 and pair 1 at margin -1e4 (rows c0 c1 r0 r1):
    rewards s - ref of +-1e4 / beta on the chosen rows, 0 on the rejected ones."""
    return sums.detach().double() - torch.tensor([1e4, -1e4, 0.0, 0.0], dtype=torch.float64) / beta


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_dpo_loss_and_gradient_are_finite_and_right_at_saturated_margins(dtype):
    """DPO at margins +-1e4 (sigmoid saturated both ways), full and streamed: loss 1e4/2, gradient +-beta/P or 0."""
    torch.manual_seed(0)
    labels = torch.randint(0, 50, (4, 7))
    labels[:, :2] = -100
    labels[3, 5:] = -100  # the rejected responses of unequal length
    beta = 0.1
    logps = (-torch.rand(4, 7, dtype=torch.float64) * 3).to(dtype)
    counted = shift_labels(labels) != -100
    ref = _saturating_refs((logps * counted).sum(dim=1), beta)
    dpo = DPO(labels, ref_logps=ref, beta=beta)
    # expected, in Python floats: pair 0 costs softplus(-1e4) = 0, pair 1 softplus(1e4) = 1e4
    sums = [float(logps[b].double()[counted[b]].sum()) for b in range(4)]
    margins = [beta * ((sums[p] - float(ref[p])) - (sums[p + 2] - float(ref[p + 2]))) for p in range(2)]
    assert margins == pytest.approx([1e4, -1e4], rel=1e-6)
    expected_loss = sum(max(-m, 0.0) + math.log1p(math.exp(-abs(m))) for m in margins) / 2
    sigmoid_neg = [math.exp(-m) / (1 + math.exp(-m)) if m > 0 else 1 / (1 + math.exp(m)) for m in margins]  # 0, 1
    per_row = torch.tensor([-sigmoid_neg[0], -sigmoid_neg[1], sigmoid_neg[0], sigmoid_neg[1]]) * beta / 2
    expected_grad = (per_row[:, None] * counted).to(dtype)

    full = logps.clone().requires_grad_()
    loss = dpo.loss_from_logps(full)
    loss.backward()

    streamed = logps.clone().requires_grad_()
    dpo.prepare(dpo.masked(streamed.detach()).sum(dim=1)[:, None])  # pass 1: the (B, 1) sums
    total = sum(dpo.loss_from_logps_chunk(dpo.masked(streamed[:, i : i + 2], i), i, i + 2) for i in range(0, 7, 2))
    total.backward()  # pass 2, in chunks of 2 positions
    for name, value, grad in (
        ("full", loss.detach(), full.grad),
        ("streamed", dpo.streamed_loss(total.detach()), streamed.grad),
    ):
        assert math.isfinite(float(value)) and float(value) == pytest.approx(expected_loss, rel=1e-6), name
        assert bool(grad.isfinite().all()), name
        torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-12, msg=name)


def test_dpo_exact_at_saturated_margins():
    """fp32 tiny model, one pair at margin +1e4 and one at -1e4: loss finite (1e4/2), ckpt and streambp equal bp."""
    model = tiny_model("tiny/llama", torch.float32)
    batch = make_dpo_batch(batch_size=4, seq_len=21, vocab_size=512, prompt_len=5)
    ref = _saturating_refs(_current_logps(model, batch).sum(dim=1), batch.beta)
    batch = DPOBatch(**{**batch.__dict__, "ref_logps": ref})
    for result in compare_methods(model, batch, ["ckpt", "streambp"], SETTINGS):
        assert result.ok, f"{result.method} differs from bp:\n" + "\n".join(d.describe() for d in result.failures())
        assert result.loss.reference == pytest.approx(1e4 / 2, rel=1e-5)


def _lora_cases():
    """objective x family (tied and untied embeddings) x dtype; the fast tier keeps one per objective."""
    fast = {("grpo", "tiny/qwen3", "fp64"), ("dpo", "tiny/mistral", "fp64")}
    for objective in ("grpo", "dpo"):
        for family in ("tiny/qwen3", "tiny/mistral"):
            for dtype, name in ((torch.float64, "fp64"), (torch.float32, "fp32")):
                marks = () if (objective, family, name) in fast else pytest.mark.slow
                yield pytest.param(objective, family, dtype, id=f"{objective}-{family}-{name}", marks=marks)


@pytest.mark.parametrize(("objective", "family", "dtype"), list(_lora_cases()))
def test_lora_objectives_exact(objective, family, dtype):
    """GRPO (off-policy, a group of 3) and DPO (two pairs) on a LoRA model: adapter gradients exact."""
    from sbpbench.data import make_batch
    from sbpbench.models.lora import apply_lora

    model = apply_lora(tiny_model(family, dtype), rank=4, alpha=8, init_nonzero_seed=0)
    batch = make_batch(objective, batch_size=3 if objective == "grpo" else 4, seq_len=27, vocab_size=512, prompt_len=5)
    if objective == "grpo":
        batch = _off_policy(model, batch)
    _assert_exact(model, batch)
