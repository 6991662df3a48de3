"""The training step (`--step train`): every method moves the parameters the same way, and the
optimizer's state is measured; GRPO/DPO/LoRA points run through the runner."""

from __future__ import annotations

import copy

import pytest
import torch

from sbpbench.config import RunSpec
from sbpbench.data import make_batch
from sbpbench.methods import MethodSettings, make_optimizer, run_step
from sbpbench.methods.exactness import tensor_diff
from sbpbench.models.lora import apply_lora
from sbpbench.runner.point import measure_point

from ..conftest import tiny_model

SETTINGS = MethodSettings(chunk_size=6, logits_chunk_size=5)


def _updates(model, method, batch) -> dict[str, torch.Tensor]:
    """Parameter change of one AdamW training step of `method` on a copy of the model."""
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    run_step(method, model, batch, SETTINGS, make_optimizer(model))
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


@pytest.mark.parametrize("objective", ["sft", "grpo", "dpo"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_train_step_moves_parameters_identically(objective, lora):
    """fp64: the AdamW update of ckpt and streambp equals bp's to 1e-9 of the largest update.

    Adam's first step is lr * g / (|g| + eps): for gradients near eps (1e-8) it magnifies the
    gradient's rounding, so the bound is 1e-9 rather than the gradient's 1e-10."""
    model = tiny_model("tiny/qwen3" if lora else "tiny/mistral", torch.float64)
    if lora:
        model = apply_lora(model, rank=4, alpha=8, init_nonzero_seed=0)
    batch = make_batch(objective, batch_size=2 if objective != "grpo" else 3, seq_len=23, vocab_size=512, prompt_len=5)
    reference = _updates(model, "bp", batch)
    moved = [n for n, d in reference.items() if bool(d.abs().max() > 0)]
    assert moved and (not lora or all("lora_" in n for n in moved))
    for method in ("ckpt", "streambp"):
        updates = _updates(model, method, batch)
        for name, ref in reference.items():
            diff = tensor_diff(name, updates[name], ref, 1e-9)
            assert diff.ok, f"{method}: {diff.describe()}"


def _spec(**values) -> RunSpec:
    return RunSpec(**({"model": "tiny/qwen3", "method": "streambp", "seq_len": 48, "warmup": 0, "repeats": 1} | values))


def test_train_point_records_optimizer_state():
    """step train: Adam's two moments per trainable parameter are resident (steady) and recorded."""
    row = measure_point(_spec(step="train"))
    assert row.status == "ok", row.error
    assert row.optimizer_state_bytes >= 2 * row.grads_bytes
    assert row.baseline_bytes >= row.weights_bytes + row.grads_bytes + 2 * row.grads_bytes


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["grpo", "dpo"])
def test_lora_preference_points_run_for_every_method(objective):
    """GRPO and DPO with LoRA through the runner: only adapters are trainable, every method ok."""
    for method in ("bp", "ckpt", "streambp"):
        row = measure_point(_spec(method=method, objective=objective, batch_size=4, lora_rank=4, lora_alpha=8))
        assert row.status == "ok", row.error
        assert 0 < row.trainable_params < row.num_params / 10
        assert row.objective == objective and row.prompt_len == 24 and row.lora_rank == 4


def test_odd_dpo_batch_is_refused():
    """A DPO point with an odd batch (no whole pairs) is refused when the spec is made."""
    with pytest.raises(ValueError, match="even number"):
        _spec(objective="dpo", batch_size=3)
