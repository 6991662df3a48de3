"""LoRA through peft: every method gives standard BP's loss and adapter gradients, and leaves the
PeftModel as found."""

from __future__ import annotations

import sys

import pytest
import torch

from sbpbench.core import UnsupportedModelError
from sbpbench.core.internal import resolve_parts
from sbpbench.methods import MethodSettings, run_method
from sbpbench.methods.exactness import compare_methods
from sbpbench.models import apply_lora

from ..conftest import FAMILIES, padded_batch, streamed, tiny_model
from .test_model_unchanged import _snapshot

peft = pytest.importorskip("peft")

SETTINGS = MethodSettings(chunk_size=7, logits_chunk_size=5)  # neither divides T = 29


def _lora_model(family: str, dtype=torch.float64, **lora):
    return apply_lora(tiny_model(family, dtype), **({"rank": 4, "alpha": 8, "init_nonzero_seed": 0} | lora))


def _batch(model):
    return padded_batch(model, batch_size=3, seq_len=29, lengths=[29, 20, 11])


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _assert_exact(model, batch):
    for result in compare_methods(model, batch, ["ckpt", "streambp"], SETTINGS):
        assert result.ok, f"{result.method} differs from bp:\n" + "\n".join(d.describe() for d in result.failures())


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_methods_match_bp_fp64(family):
    """With LoRA (tied and untied embeddings), ckpt and streambp give bp's loss and every adapter gradient to 1e-10."""
    model = _lora_model(family)
    _assert_exact(model, _batch(model))


def test_lora_methods_match_bp_fp32():
    """In float32, ckpt and streambp give bp's loss and every adapter gradient to 1e-5."""
    model = _lora_model("tiny/qwen2", torch.float32)
    _assert_exact(model, _batch(model))


def test_only_adapters_get_gradients():
    """Base weights are frozen and get no .grad from streambp; every lora_A and lora_B gets a nonzero one."""
    model = _lora_model("tiny/qwen3")
    names = [name for name, _ in model.named_parameters()]
    assert any(_is_adapter(n) for n in names)
    assert all(p.requires_grad == _is_adapter(n) for n, p in model.named_parameters())
    run_method("streambp", model, _batch(model), SETTINGS)
    for name, p in model.named_parameters():
        if _is_adapter(name):
            assert p.grad is not None and bool(p.grad.ne(0).any()), name
        else:
            assert p.grad is None, name


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "hf_checkpointing_on"])
@pytest.mark.parametrize("method", ["bp", "ckpt", "streambp"])
def test_step_leaves_peft_model_as_found(method, checkpointing):
    """state_dict keys, attention implementation, checkpointing and training flags, hooks, instance
    attributes and a forward's output of a PeftModel are identical before and after a step."""
    model = _lora_model("tiny/llama")
    model.eval()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = _batch(model)
    before = _snapshot(model, batch)
    run_method(method, model, batch, SETTINGS)
    after = _snapshot(model, batch)
    for key in ("keys", "attn", "checkpointing", "training", "hooks", "instance_attrs"):
        assert after[key] == before[key], key
    assert torch.equal(after["logits"], before["logits"])


def test_parts_of_a_peft_model_are_the_base_models():
    """resolve_parts unwraps a PeftModel; its config is the object the attention layers read, so the
    attention-implementation switch reaches them."""
    model = _lora_model("tiny/qwen3")
    base = model.get_base_model()
    parts = resolve_parts(model)
    assert parts.model is base and parts.lm_head is base.lm_head and parts.layers is base.model.layers
    assert all(layer.self_attn.config is parts.config for layer in parts.layers)
    assert type(parts.lm_head) is torch.nn.Linear  # "all-linear" leaves the lm_head alone


def test_apply_lora_defaults_are_the_papers():
    """Defaults: rank 32, alpha 128, dropout 0, every linear layer but the lm_head, B zero-initialised."""
    model = apply_lora(tiny_model("tiny/qwen3"))
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (32, 128, 0.0)
    wrapped = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, peft.tuners.lora.Linear)}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(p.eq(0).all() for n, p in model.named_parameters() if ".lora_B." in n)


def test_bf16_model_keeps_fp32_adapters():
    """peft's default autocast keeps adapters in float32 beside bf16 base weights, and streambp runs on it."""
    model = _lora_model("tiny/qwen3", torch.bfloat16)
    dtypes = {_is_adapter(n): set() for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        dtypes[_is_adapter(name)].add(p.dtype)
    assert dtypes == {True: {torch.float32}, False: {torch.bfloat16}}
    run_method("streambp", model, _batch(model), SETTINGS)
    assert all(p.grad.dtype == torch.float32 for n, p in model.named_parameters() if _is_adapter(n))


def test_init_nonzero_seed_is_seeded():
    """The same seed gives the same lora_B weights, a different seed different ones."""
    weights = [
        [p.clone() for n, p in _lora_model("tiny/qwen3", init_nonzero_seed=seed).named_parameters() if ".lora_B." in n]
        for seed in (0, 0, 1)
    ]
    assert all(torch.equal(a, b) for a, b in zip(weights[0], weights[1]))
    assert not any(torch.equal(a, c) for a, c in zip(weights[0], weights[2]))


@pytest.mark.parametrize(
    "kwargs,message", [({"rank": 0}, "rank"), ({"alpha": 0}, "alpha"), ({"dropout": 1.0}, "dropout")]
)
def test_apply_lora_rejects_bad_settings(kwargs, message):
    """A rank below 1, a non-positive alpha or a dropout outside [0, 1) is a ValueError naming the setting."""
    with pytest.raises(ValueError, match=message):
        apply_lora(tiny_model("tiny/qwen3"), **kwargs)


def test_apply_lora_without_peft_says_what_to_install(monkeypatch):
    """Without peft installed, apply_lora says how to get it."""
    monkeypatch.setitem(sys.modules, "peft", None)  # makes `import peft` raise ImportError
    with pytest.raises(ImportError, match="LoRA needs peft: pip install peft"):
        apply_lora(tiny_model("tiny/qwen3"))


def test_lora_dropout_in_training_is_refused():
    """Active LoRA dropout would draw new masks in every re-forward: streambp refuses it."""
    model = _lora_model("tiny/qwen3", dropout=0.1)
    model.train()
    batch = _batch(model)
    with pytest.raises(UnsupportedModelError, match="lora_dropout=0"):
        streamed(model, batch.input_ids, batch.labels, attention_mask=batch.attention_mask)


def test_adapters_streambp_cannot_follow_are_refused():
    """LoRA on the lm_head and prompt tuning (outside the decoder layers) are refused, never half-trained."""
    lm_head_lora = peft.get_peft_model(
        tiny_model("tiny/qwen2"), peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM")
    )
    with pytest.raises(UnsupportedModelError, match="lm_head"):
        resolve_parts(lm_head_lora)
    prompt_tuning = peft.get_peft_model(
        tiny_model("tiny/qwen3"), peft.PromptTuningConfig(num_virtual_tokens=3, task_type="CAUSAL_LM")
    )
    with pytest.raises(UnsupportedModelError, match="prompt learning"):
        resolve_parts(prompt_tuning)
