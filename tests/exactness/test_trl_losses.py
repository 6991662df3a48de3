"""Each TRL loss option StreamBP takes, against TRL's own loss code: `GRPOTrainer._compute_loss` and
`DPOTrainer._compute_loss` (TRL 1.16) run on a tiny fp64 model, their loss and every parameter
gradient compared with `stream_backward`'s (fp64, 1e-10).

TRL's code runs unmodified, called with a stand-in for the trainer (the attributes the method
reads) and for the model's fused LM head: TRL's fused head computes log-probs in fp32 even for an
fp64 model, so both sides get the same fp64 log-prob math (core token_logps) from the same fp64
logits of transformers' forward with TRL's attention_mask. Needs the `.[trl]` extra."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from sbpbench.core import DPO, GRPO
from sbpbench.core.objectives import DPO_LOSS_TYPES, token_logps

from ..conftest import grpo_rows, tiny_model
from .test_layouts import assert_same, streamed_step

trl = pytest.importorskip("trl", minversion="1.16", reason="needs TRL >= 1.16: pip install -e '.[trl]'")
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402 (after the skip when TRL is absent)
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

PROMPT_WIDTH, COMPLETION_WIDTH = 9, 15
PROMPTS = [9, 4, 6, 9]


def _accelerator():
    same = lambda tensor, **kwargs: tensor
    return SimpleNamespace(
        num_processes=1, device=torch.device("cpu"), gather=same, reduce=same, gather_for_metrics=same
    )


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _completion_logps(model, input_ids, attention_mask, completion_ids, completion_mask, temperature):
    """(B, C) fp64 log-probs of the completion tokens, 0 on completion padding (as TRL's fused head)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -completion_ids.shape[1] - 1 : -1]
    return token_logps(logits, completion_ids.masked_fill(completion_mask == 0, -100), temperature)


def _grpo_trainer(model, *, temperature, loss_type, beta, epsilon_high, importance_sampling_level, args, steps):
    """What GRPOTrainer._compute_loss reads of its trainer, with TRL's per-token log-probs replaced by fp64 ones."""

    def logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        completion_ids = input_ids[:, -logits_to_keep:]
        completion_mask = attention_mask[:, -logits_to_keep:]
        logps = _completion_logps(model, input_ids, attention_mask, completion_ids, completion_mask, temperature)
        return logps, torch.zeros_like(logps), None

    return SimpleNamespace(
        _get_per_token_logps_and_entropies=logps_and_entropies,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=importance_sampling_level,
        beta=beta,
        args=SimpleNamespace(**args),
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=epsilon_high,
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=steps,
        max_completion_length=COMPLETION_WIDTH,
        accelerator=_accelerator(),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )


GRPO_CASES = {  # name -> GRPOConfig options; TRL's defaults: beta 0.0, loss_type dapo, use_bias_correction_kl True
    "trl-defaults": {},
    "grpo-kl": {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": False},
    "grpo-bias-kl": {"loss_type": "grpo", "beta": 0.04},
    "bnpo-clip-higher": {"loss_type": "bnpo", "beta": 0.04, "epsilon_high": 0.28},
    "dr_grpo-delta": {"loss_type": "dr_grpo", "beta": 0.04, "delta": 1.3},
    "dapo-window": {"beta": 0.04, "num_items_in_batch": 90.0, "steps": 2, "steps_per_generation": 4},
    "temperature": {"loss_type": "grpo", "beta": 0.04, "temperature": 0.7},
}


def _grpo_case(model, case: dict, level: str, *, off_policy: bool, completions):
    """Run TRL's loss and StreamBP's on the same batch; return both (loss, grads)."""
    case = {
        "loss_type": "dapo",
        "beta": 0.0,
        "use_bias_correction_kl": True,
        "temperature": 1.0,
        "epsilon_high": None,
        "delta": None,
        "steps": 1,
        "steps_per_generation": 1,
        "num_items_in_batch": None,
    } | case
    input_ids, attention_mask, labels = grpo_rows(
        model,
        prompt_lengths=PROMPTS,
        completion_lengths=completions,
        prompt_width=PROMPT_WIDTH,
        completion_width=COMPLETION_WIDTH,
    )
    completion_ids, completion_mask = input_ids[:, PROMPT_WIDTH:], attention_mask[:, PROMPT_WIDTH:]
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        current = _completion_logps(
            model, input_ids, attention_mask, completion_ids, completion_mask, case["temperature"]
        )
    noisy = lambda: current + 0.3 * torch.randn(current.shape, generator=generator, dtype=current.dtype)
    old, ref = (noisy() if off_policy else None), noisy()
    advantages = torch.randn(len(PROMPTS), generator=generator, dtype=torch.float64)
    num_items = case["num_items_in_batch"] or float(completion_mask.sum())
    inputs = {
        "prompt_ids": input_ids[:, :PROMPT_WIDTH],
        "prompt_mask": attention_mask[:, :PROMPT_WIDTH],
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(num_items, dtype=torch.float64),
    }
    trainer = _grpo_trainer(
        model,
        temperature=case["temperature"],
        loss_type=case["loss_type"],
        beta=case["beta"],
        epsilon_high=case["epsilon_high"] if case["epsilon_high"] is not None else 0.2,
        importance_sampling_level=level,
        args={k: case[k] for k in ("use_bias_correction_kl", "delta", "steps_per_generation")},
        steps=case["steps"],
    )
    model.zero_grad(set_to_none=True)
    loss = GRPOTrainer._compute_loss(trainer, model, inputs)
    loss.backward()
    theirs = (loss.detach(), _grads(model))

    def per_target(completion_logps):  # (B, C) per completion token -> (B, T) per target position
        if completion_logps is None:
            return None
        full = torch.zeros(labels.shape, dtype=torch.float64)
        full[:, PROMPT_WIDTH - 1 : -1] = completion_logps
        return full

    objective = GRPO(
        labels,
        advantages=advantages,
        ref_logps=per_target(ref),
        old_logps=per_target(old),
        beta=case["beta"],
        epsilon=0.2,
        epsilon_high=case["epsilon_high"],
        delta=case["delta"],
        loss_type=case["loss_type"],
        importance_sampling_level=level,
        use_bias_correction_kl=case["use_bias_correction_kl"],
        temperature=case["temperature"],
        max_completion_length=COMPLETION_WIDTH,
        num_items_in_batch=num_items,
        gradient_accumulation_steps=case["steps"],
        steps_per_generation=case["steps_per_generation"],
    )
    ours = streamed_step(
        model, input_ids, objective=objective, attention_mask=attention_mask, chunk_size=5, logits_chunk_size=7
    )
    return ours, theirs


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("case", GRPO_CASES)
def test_grpo_matches_trl(case, level):
    """GRPO per TRL option, token and sequence (GSPO) importance sampling, off-policy: TRL's loss and gradients."""
    model = tiny_model("tiny/qwen3")
    ours, theirs = _grpo_case(model, GRPO_CASES[case], level, off_policy=True, completions=[12, 15, 3, 8])
    assert_same(model, ours, theirs, f"grpo {case} {level}")


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_on_policy_with_an_empty_completion_matches_trl(loss_type, level):
    """On-policy (no old log-probs), one completion without tokens (TRL: its terms are 0), Gemma-3 (windows)."""
    model = tiny_model("tiny/gemma3")
    case = {"loss_type": loss_type, "beta": 0.04}
    ours, theirs = _grpo_case(model, case, level, off_policy=False, completions=[12, 0, 3, 8])
    assert_same(model, ours, theirs, f"grpo {loss_type} {level}")


class _FusedHead:
    """The model as DPOTrainer calls it (`model(..., labels=..., fused_lm_head=True)`), with fp64 log-probs."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *, input_ids, attention_mask, labels, fused_lm_head, use_cache):
        assert fused_lm_head
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        logps = token_logps(logits, labels[:, 1:])
        zeros = torch.zeros_like(logps)
        return SimpleNamespace(log_probs=logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool(), aux_loss=None)


def _dpo_trainer(loss_types, loss_weights, **options):
    return SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=_accelerator(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type=options.get("f_divergence_type", "reverse_kl"),
        f_alpha_divergence_coef=0.5,
        loss_types=list(loss_types),
        loss_weights=list(loss_weights),
        beta=options.get("beta", 0.1),
        label_smoothing=options.get("label_smoothing", 0.0),
        args=SimpleNamespace(discopop_tau=0.05),
        use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
    )


DPO_CASES = {
    **{name: {"loss_type": (name,), "label_smoothing": 0.1} for name in DPO_LOSS_TYPES},
    "sigmoid-forward_kl": {"loss_type": ("sigmoid",), "f_divergence_type": "forward_kl", "beta": 0.05},
    "sigmoid-js_divergence": {"loss_type": ("sigmoid",), "f_divergence_type": "js_divergence"},
    "sigmoid+sft": {"loss_type": ("sigmoid", "sft"), "loss_weights": (1.0, 0.3)},
}


def _dpo_case(model, case: dict, *, empty_rejected: bool):
    """Two pairs as TRL batches them (chosen rows, then rejected rows; right padding)."""
    rows, seq_len, prompt = 4, 21, 7
    generator = torch.Generator().manual_seed(4)
    input_ids = torch.randint(0, model.config.vocab_size, (rows, seq_len), generator=generator)
    ends = torch.tensor([21, 16, 19, prompt if empty_rejected else 12])[:, None]
    positions = torch.arange(seq_len)[None, :]
    attention_mask = (positions < ends).long()
    completion_mask = attention_mask * (positions >= prompt)
    ref = -6.0 * torch.rand(rows, generator=generator, dtype=torch.float64) - 20.0
    inputs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref[:2],
        "ref_rejected_logps": ref[2:],
    }
    options = {k: v for k, v in case.items() if k not in ("loss_type", "loss_weights")}
    weights = case.get("loss_weights", (1.0,) * len(case["loss_type"]))
    model.zero_grad(set_to_none=True)
    loss = DPOTrainer._compute_loss(
        _dpo_trainer(case["loss_type"], weights, **options), _FusedHead(model), inputs, False
    )
    loss.backward()
    theirs = (loss.detach(), _grads(model))
    labels = input_ids.masked_fill(completion_mask == 0, -100)
    objective = DPO(labels, ref_logps=ref, loss_type=case["loss_type"], loss_weights=weights, **options)
    ours = streamed_step(
        model, input_ids, objective=objective, attention_mask=attention_mask, chunk_size=4, logits_chunk_size=6
    )
    return ours, theirs


@pytest.mark.parametrize("case", DPO_CASES)
def test_dpo_matches_trl(case):
    """Every DPO loss type TRL computes from sequence sums (label_smoothing 0.1), f-divergences, a weighted mix."""
    model = tiny_model("tiny/llama")
    ours, theirs = _dpo_case(model, DPO_CASES[case], empty_rejected=False)
    assert_same(model, ours, theirs, f"dpo {case}")


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "apo_zero"])
def test_dpo_empty_rejected_response_matches_trl(loss_type):
    """A rejected response without tokens: TRL's sum 0 and its loss, not a refusal."""
    model = tiny_model("tiny/llama")
    ours, theirs = _dpo_case(model, {"loss_type": (loss_type,)}, empty_rejected=True)
    assert_same(model, ours, theirs, f"dpo {loss_type}")


@pytest.mark.slow
def test_core_does_not_import_trl():
    """sbpbench.core never imports TRL: it stays an optional extra."""
    import subprocess
    import sys

    code = "import sys, sbpbench.core, sbpbench.methods; assert 'trl' not in sys.modules, 'trl imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
