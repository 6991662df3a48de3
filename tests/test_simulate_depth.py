"""Depth extrapolation for long-sequence predictions: from the 2- and 3-layer models to the full
depth, equal to the full-depth fake run to the byte, peak phase included."""

from __future__ import annotations

import pytest

from sbpbench.config import RunSpec
from sbpbench.methods import MethodSettings
from sbpbench.records import row_key
from sbpbench.simulate import estimate_point
from sbpbench.simulate.depth import estimate_point_by_depth, uniform_layers

CASES = [
    ("tiny/qwen3", 1024, 8, "bp"),
    ("tiny/qwen3", 1024, 8, "ckpt"),
    ("tiny/qwen3", 1024, 8, "streambp"),  # peak in the top layer's backward
    ("tiny/llama", 512, 7, "streambp"),
    ("tiny/llama", 512, 7, "ckpt"),
    ("Qwen/Qwen3-0.6B", 2048, None, "bp"),  # the real shape, full depth 28, peak in the head
    ("Qwen/Qwen3-0.6B", 2048, None, "ckpt"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "seq_len", "num_layers", "method"), CASES)
def test_two_shallow_runs_predict_the_full_depth_to_the_byte(model, seq_len, num_layers, method):
    """Extrapolated from 2- and 3-layer fake runs: the full-depth fake run's byte columns and peak phase."""
    spec = RunSpec(
        model=model,
        method=method,
        seq_len=seq_len,
        dtype="bf16",
        num_layers=num_layers,
        settings=MethodSettings(chunk_size=128, logits_chunk_size=64),
        memory_limit=80 << 30,
    )
    full = estimate_point(spec, gpu_memory_bytes=80 << 30)
    extrapolated = estimate_point_by_depth(spec, gpu_memory_bytes=80 << 30)
    assert full.status == extrapolated.status == "ok"
    for column in ("weights_bytes", "grads_bytes", "baseline_bytes", "peak_allocated_bytes", "activation_peak_bytes",
                   "margin_bytes", "num_params", "num_layers", "peak_phase", "attention_kernel"):  # fmt: skip
        assert getattr(extrapolated, column) == getattr(full, column), column
    assert row_key(extrapolated) == row_key(full)  # the same point in a results file


def test_only_models_whose_layers_are_all_alike_are_extrapolated():
    """Depth extrapolation applies to uniform-layer models and not to Gemma's mixed sliding/global layers."""
    assert uniform_layers("Qwen/Qwen3-8B") and uniform_layers("meta-llama/Llama-3.1-8B")
    assert not uniform_layers("google/gemma-3-1b-pt")  # sliding and global layers
