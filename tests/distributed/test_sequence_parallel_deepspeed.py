"""Sequence-parallel StreamBP under DeepSpeed ZeRO-1/2/3 with DeepSpeed's own sequence-parallel
groups (ALST's `parallel_state_sp`, given to `deepspeed.initialize` as its mpu): 2 gloo ranks share
one sequence; the engine's gradients equal one process's standard BP on the whole batch.

DeepSpeed averages gradients over its sequence-data-parallel group (here both ranks), so the step
scales each rank's loss by P (core/parallel/sequence_step.py). One spawn for every case.
"""

from __future__ import annotations

import pytest
import torch

from ..conftest import tiny_model
from .ranks import deepspeed_rank, run_distributed, serve_cases
from .test_distributed import _assert_close

pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra: pip install -e '.[deepspeed]'")

pytestmark = pytest.mark.slow

SEQ = 21  # not a multiple of 2 ranks x 3 chunks
CASES = [
    {"name": f"zero{stage}_{objective}", "stage": stage, "objective": objective}
    for stage, objective in ((1, "sft"), (2, "sft"), (3, "sft"), (2, "grpo"), (3, "dpo"))
]
REFUSED = {"name": "zero3_without_reduce_scatter", "stage": 3, "objective": "sft", "reduce_scatter": False}


def _batch(objective: str, vocab: int):
    from sbpbench.data import make_batch

    return make_batch(objective, batch_size=2, seq_len=SEQ, vocab_size=vocab, prompt_len=6, seed=7)


def _run_case(case, rank):
    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import safe_get_full_grad

    from sbpbench.core import SequenceParallel, StreamConfig, stream_backward

    model = tiny_model("tiny/qwen3", torch.float32)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {
            "stage": case["stage"],
            "stage3_param_persistence_threshold": 0,
            "reduce_scatter": case.get("reduce_scatter", True),
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=parallel_state_sp)
    batch = _batch(case["objective"], model.config.vocab_size)  # every rank: the same whole batch
    try:
        loss = stream_backward(
            engine, batch.input_ids, objective=batch.objective(), config=StreamConfig(chunk_size=4, logits_chunk_size=4),
            sequence_parallel=SequenceParallel.from_deepspeed(),
        )  # fmt: skip
    except ValueError as error:
        engine.destroy()
        return {}, {"error": str(error)}
    grads = {}
    for name, param in engine.module.named_parameters():
        grad = safe_get_full_grad(param)  # collective under ZeRO-3: every rank calls it
        if grad is not None:
            grads[name] = grad.detach().clone().numpy()
    engine.destroy()
    return grads, {"loss": float(loss)}


def _worker(rank, port, cases, queue):
    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    deepspeed_rank(rank, port)
    deepspeed.init_distributed(dist_backend="gloo")
    parallel_state_sp.initialize_sequence_parallel(2)
    serve_cases(rank, cases, queue, _run_case, finish=torch.distributed.destroy_process_group)


@pytest.fixture(scope="module")
def results():
    return run_distributed([*CASES, REFUSED], _worker)


def _reference(objective: str) -> tuple[dict, float]:
    """Standard BP of the whole batch in one process."""
    model = tiny_model("tiny/qwen3", torch.float32)
    batch = _batch(objective, model.config.vocab_size)
    loss = batch.objective().full_loss(model(input_ids=batch.input_ids).logits)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}, float(loss)


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_gradients_equal_one_process_bp(results, case):
    """ZeRO-1/2/3 with DeepSpeed's sequence-parallel group: the engine's gradients and the loss equal
    one process's on the whole sequence, to fp32 rounding."""
    grads, counts = results[case["name"]]
    reference, loss = _reference(case["objective"])
    _assert_close(case["name"], {k: torch.as_tensor(v) for k, v in grads.items()}, reference)
    assert counts["loss"] == pytest.approx(loss, rel=1e-5)


def test_zero3_without_reduce_scatter_is_refused(results):
    """ZeRO-3 with reduce_scatter false divides some buckets by the sequence ranks and others not:
    refused before any work, in one line saying what to set."""
    _, counts = results[REFUSED["name"]]
    assert "keep zero_optimization.reduce_scatter true" in counts["error"]
