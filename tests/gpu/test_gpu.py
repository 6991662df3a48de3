"""On a CUDA GPU: exactness at the paper's length (T = 9000) through the CUDA attention kernels.

Skipped without a GPU (conftest.py). fp32 is judged against a float64 step on the same weights,
each method's loss and gradients within a small factor of standard BP's own fp32 error
(methods/exactness.py `judge_against_fp64`; a fixed 1e-5 between two fp32 methods fails on rounding
alone at T=9000). The fp64 step is StreamBP's (FP64_REFERENCE): standard BP in fp64 keeps T x T
attention probabilities per layer (no fused CUDA kernel takes fp64), over 120 GB for six Qwen3-4B
layers; bp's own fp32 step is checked against it, so a broken fp64 StreamBP fails the test rather
than hiding. bf16 cannot be judged by a tolerance either, so, as in the paper's Table 6, each bf16
method's gradients are compared with that fp64 step on the same weights (bf16 values, so the bf16
model is the same function), and StreamBP's error must not exceed standard BP's own bf16 error by
more than a small factor.

Time: the fp64 step takes most of a test (no fused kernel: attention materialises chunk x T
scores), so one model and its fp64 step per shape (a module fixture) serve both the fp32 and the
bf16 test, and the depth is cut (errors are judged against bp's own at the same depth). StreamBP's
chunk attention is pinned to the lower-right reference: these tests are about the methods, the
kernels have theirs (test_gpu_kernels.py). The `quick` tests are the subset `sbp selftest` runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from sbpbench.core.internal import LOWER_RIGHT
from sbpbench.methods import MethodSettings
from sbpbench.methods.exactness import Step, fp64_step, judge_against_fp64, step_gradients
from sbpbench.models import build_model

from ..conftest import padded_batch

pytestmark = pytest.mark.gpu

DEVICE = "cuda"  # test_gpu_tier.py runs these tests on a CPU stand-in (tiny shapes, short T)
SEQ_LEN = 9000
# the paper's timing partitions; the lower-right chunk kernel, auto's own (test_gpu_kernels.py checks the others)
SETTINGS = MethodSettings(chunk_size=SEQ_LEN // 3, logits_chunk_size=100, chunk_attention=LOWER_RIGHT)
# Real per-layer shapes, six layers each: so bp (full activations) fits beside the fp64 step's
# gradients, and the fp64 step (linear in depth) stays short.
SHAPES = {"Qwen/Qwen3-0.6B": {"num_hidden_layers": 6}, "Qwen/Qwen3-4B": {"num_hidden_layers": 6}}
FP64_REFERENCE = "streambp"
# the objectives: a 4-layer Qwen3-0.6B, T=4096, chunks of 1000 positions and 100 logits
OBJECTIVE_SHAPE = ("Qwen/Qwen3-0.6B", {"num_hidden_layers": 4})
OBJECTIVE_SEQ_LEN = 4096
OBJECTIVE_SETTINGS = MethodSettings(chunk_size=1000, logits_chunk_size=100, chunk_attention=LOWER_RIGHT)


def _assert_judged(results) -> None:
    for result in results:
        print(
            f"{result.method} vs {result.reference}: loss {result.loss.rel_error:.2e}, worst {result.worst.describe()}"
        )
    for result in results:
        assert result.ok, f"{result.method} vs {result.reference}:\n" + "\n".join(
            d.describe() for d in result.failures()
        )


def _cuda_model(name, dtype, overrides):
    return build_model(name, dtype=dtype, device=DEVICE, **overrides)


@dataclass
class Shape:
    """An fp32 model whose weights are bf16 values, the paper's batch, and its fp64 step."""

    name: str
    model: torch.nn.Module
    batch: object
    reference: Step


def build_shape(name: str) -> Shape:
    model = _cuda_model(name, torch.bfloat16, SHAPES[name]).float()  # exact: bf16 values in fp32
    batch = padded_batch(model, batch_size=1, seq_len=SEQ_LEN, lengths="paper").to(DEVICE)
    return Shape(name, model, batch, fp64_step(FP64_REFERENCE, model, batch, SETTINGS))


@pytest.fixture(scope="module", params=[pytest.param("Qwen/Qwen3-0.6B", marks=pytest.mark.quick), "Qwen/Qwen3-4B"])
def shape(request) -> Shape:
    return build_shape(request.param)


def test_cuda_fp32_methods_match_bp(shape):
    """fp32 on CUDA at T=9000: against an fp64 step, ckpt's and streambp's errors (loss and every
    gradient) are within a small factor of bp's own fp32 error."""
    methods = ["ckpt", "streambp"]
    _assert_judged(
        judge_against_fp64(
            shape.model, shape.batch, methods, SETTINGS, reference_method=FP64_REFERENCE, reference=shape.reference
        )
    )


def _relative_error(grads, reference) -> float:
    """||g - ref|| / ||ref|| over all parameters together (Frobenius norms)."""
    num = sum(float((grads[n].double() - r.double()).norm() ** 2) for n, r in reference.items())
    den = sum(float(r.double().norm() ** 2) for r in reference.values())
    return (num / den) ** 0.5


def _parameters_to(model, dtype) -> None:
    """Cast the parameters only: a bf16 HF model keeps its rotary inv_freq buffer in fp32, which a
    round trip through bf16 would round."""
    for parameter in model.parameters():
        parameter.data = parameter.data.to(dtype)


def test_cuda_bf16_streambp_error_is_bp_error(shape):
    """bf16 on CUDA at T=9000: against the fp64 step on the same (bf16-valued) weights, streambp's
    gradient error is within 1.5x of bf16 bp's own error."""
    _, reference = shape.reference
    _parameters_to(shape.model, torch.bfloat16)  # exact: the weights are bf16 values
    try:
        errors = {
            m: _relative_error(step_gradients(m, shape.model, shape.batch, SETTINGS)[1], reference)
            for m in ("bp", "streambp")
        }
    finally:
        _parameters_to(shape.model, torch.float32)
    print(f"{shape.name}: bf16 gradient error vs fp64: bp {errors['bp']:.3e}, streambp {errors['streambp']:.3e}")
    assert errors["streambp"] <= 1.5 * errors["bp"]


@pytest.mark.parametrize("objective", ["grpo", "dpo"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_cuda_fp32_objectives_match_bp(objective, lora):
    """fp32 on CUDA: GRPO (a group of 2) and DPO (one pair) at T=4096, full and LoRA, judged
    against an fp64 step as above."""
    from sbpbench.data import make_batch
    from sbpbench.models.lora import apply_lora

    name, overrides = OBJECTIVE_SHAPE
    model = _cuda_model(name, torch.float32, overrides)
    if lora:
        model = apply_lora(model, rank=8, alpha=16, init_nonzero_seed=0)
    batch = make_batch(
        objective, batch_size=2, seq_len=OBJECTIVE_SEQ_LEN, vocab_size=model.config.vocab_size, device=DEVICE
    )
    methods = ["ckpt", "streambp"]
    _assert_judged(judge_against_fp64(model, batch, methods, OBJECTIVE_SETTINGS, reference_method=FP64_REFERENCE))
