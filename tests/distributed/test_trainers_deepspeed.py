"""The StreamBP trainers under DeepSpeed through Accelerate (TrainingArguments(deepspeed=...)) on 2
gloo ranks: an optimizer step over 2 accumulated micro-batches, stock vs StreamBP, the same parameter
updates to fp32 rounding (DeepSpeed keeps fp32 weights). This checks what Accelerate hands the
step: its DeepSpeed engine, the accumulation boundary, engine.step() at it and gradients not
divided again by the accumulation steps (the Trainer's scale_wrt_gas=False). transformers' Trainer
only (see CASES).

FSDP2 through Accelerate is not run here: Accelerate turns FSDP on only for GPU process groups. The
layout it gives (embedding and [final norm, lm_head] in units of their own) is tested on CPU ranks
in tests/distributed/test_distributed.py ("accelerate" cases)."""

from __future__ import annotations

import functools
import shutil
import tempfile

import pytest
import torch

from .ranks import run_distributed, trainer_rank

pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra: pip install -e '.[deepspeed]'")
pytest.importorskip("datasets", reason="needs datasets: pip install -e '.[trl]'")

pytestmark = pytest.mark.slow

# transformers' Trainer only: TRL's trainers gather metrics with accelerator.gather_for_metrics, which
# under DeepSpeed on CPU ranks builds a one-tensor list for a 2-rank gloo group and fails (the stock
# SFTTrainer too); their step is this one plus TRL's loss options, tested in one process.
CASES = [{"name": f"trainer_zero{stage}", "stage": stage} for stage in (2, 3)]


def _train(case, streambp: bool, rank: int) -> dict:
    """One run on this rank; the full parameter updates."""
    import deepspeed
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from sbpbench import integrations
    from sbpbench.core import StreamConfig

    from ..conftest import tiny_model
    from ..exactness.test_trainers import _common, _pad_collator, _token_rows

    model = tiny_model("tiny/qwen3", torch.float32)  # before the config: ZeRO-3 would partition it at init
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": case["stage"], "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        # no clipping (Accelerate's default clips at 1.0): a clipped update would hide a wrong scale
        "gradient_clipping": 0.0,
    }
    # one optimizer step (2 micro-batches: off and on the boundary): fp32 differences compound over
    # SGD steps at rate 0.5 (one process, stock vs StreamBP, fp32: 2.3e-5 after 2 steps)
    options = {"use_cpu": False, "max_steps": 1, "deepspeed": config}
    output = tempfile.mkdtemp(prefix="sbp-trainer-")
    args = TrainingArguments(
        **_common(output) | options, train_sampling_strategy="sequential", remove_unused_columns=False
    )
    cls = integrations.StreamBPTrainer if streambp else Trainer
    kwargs = {"train_dataset": Dataset.from_list(_token_rows(16)), "data_collator": _pad_collator}
    extra = {"streambp": StreamConfig(chunk_size=5, logits_chunk_size=7)} if streambp else {}
    trainer = cls(model=model, args=args, **kwargs, **extra)
    trainer.train()
    params = list(trainer.model_wrapped.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):  # no-op below ZeRO-3
        updates = {name: (p.detach() - before[name]).numpy().copy() for name, p in params}
    trainer.model_wrapped.destroy()
    shutil.rmtree(output, ignore_errors=True)  # save_strategy "no": nothing of use there
    AcceleratorState._reset_state()  # one DeepSpeed Accelerator per process otherwise
    return updates


def _both(case, rank):
    """The stock trainer's updates and StreamBP's, as one result."""
    stock, ours = _train(case, False, rank), _train(case, True, rank)
    return {**stock, **{f"streambp:{k}": v for k, v in ours.items()}}, {}


@pytest.fixture(scope="module")
def results():
    return run_distributed(CASES, target=functools.partial(trainer_rank, run_case=_both), timeout_s=600.0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_deepspeed_trainer_matches_stock(results, case):
    """StreamBPTrainer under Accelerate's DeepSpeed ZeRO-2/3 on 2 ranks: the stock updates (fp32 rounding)."""
    updates = results[case["name"]][0]
    stock = {k: v for k, v in updates.items() if not k.startswith("streambp:")}
    # an update is after - before of fp32 parameters of magnitude <= 1 (norm weights start at 1): it
    # is resolved only to a few fp32 epsilons, whatever its own size
    floor = 4 * torch.finfo(torch.float32).eps
    for name, reference in stock.items():
        ours = updates[f"streambp:{name}"]
        scale = float(reference.abs().max())
        assert scale > 0, f"{name} did not train"
        difference = float((ours - reference).abs().max())
        assert difference <= 1e-5 * scale + floor, f"{case['name']}: {name} update differs by {difference:.2e}"
