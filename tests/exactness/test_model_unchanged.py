"""No method changes the model it was given."""

from __future__ import annotations

import pytest
import torch

from sbpbench.methods import MethodSettings, run_method

from ..conftest import FAMILIES, needs_trl, padded_batch, streamed, tiny_model


def _is_checkpointing(model) -> list[bool]:
    return [getattr(m, "gradient_checkpointing", False) for m in model.modules()]


def _snapshot(model, batch):
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return {
        "keys": list(model.state_dict()),
        "attn": model.config._attn_implementation,
        "checkpointing": _is_checkpointing(model),
        "training": [m.training for m in model.modules()],
        "hooks": [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()],
        "instance_attrs": [sorted(vars(m)) for m in model.modules()],  # e.g. no wrapped forward left behind
        "logits": logits,
    }


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "hf_checkpointing_on"])
@pytest.mark.parametrize(
    "method",
    ["ckpt", "streambp", "ckpt-offload", "ckpt-chunked-ce", "tiled", pytest.param("trl-default", marks=needs_trl)],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_step_leaves_model_as_found(family, method, checkpointing):
    """state_dict keys, attention implementation, checkpointing flags, training flags, hooks,
    instance attributes and a plain forward's output are identical before and after a step."""
    model = tiny_model(family)
    model.eval()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = padded_batch(model, batch_size=2, seq_len=12, lengths=[12, 9])
    before = _snapshot(model, batch)
    run_method(method, model, batch, MethodSettings(chunk_size=5, logits_chunk_size=5))
    after = _snapshot(model, batch)
    for key in ("keys", "attn", "checkpointing", "training", "hooks", "instance_attrs"):
        assert after[key] == before[key], key
    assert torch.equal(after["logits"], before["logits"])


def test_model_restored_after_an_error():
    """A step that fails midway (bad labels) still restores the attention implementation."""
    model = tiny_model("tiny/qwen3")
    batch = padded_batch(model, batch_size=1, seq_len=8)
    bad = batch.labels.clone()
    bad[0, 3] = model.config.vocab_size + 5  # out of range: cross-entropy fails inside the head
    with pytest.raises((IndexError, RuntimeError)):
        streamed(model, batch.input_ids, bad)
    assert model.config._attn_implementation == "sdpa"
