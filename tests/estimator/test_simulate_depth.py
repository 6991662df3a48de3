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
    ("tiny/qwen3", 512, 8, "bp", None),
    ("tiny/qwen3", 512, 8, "ckpt", None),
    ("tiny/qwen3", 512, 8, "streambp", None),  # peak in the top layer's backward
    ("tiny/llama", 512, 7, "streambp", None),
    ("tiny/llama", 512, 7, "ckpt", None),
    ("Qwen/Qwen3-0.6B", 1024, None, "bp", None),  # the real shape, full depth 28, peak in the head
    ("Qwen/Qwen3-0.6B", 1024, None, "ckpt", None),
    ("tiny/qwen3", 512, 8, "streambp", "cpu"),  # checkpoints on the host: the device holds two
    ("tiny/qwen3", 512, 11, "streambp", "recompute:3"),  # from 5 and 8 layers; a partial top segment
    ("tiny/llama", 384, 12, "streambp", "cpu+recompute:2"),  # from 4 and 6 layers
    ("tiny/qwen3", 512, 14, "streambp", "cpu+recompute:4+spill"),  # from 6 and 10; top segment [12, 14)
    ("tiny/qwen3", 512, 8, "streambp", "stream"),  # from 2 layers: nothing of a layer input on the device
    ("tiny/llama", 512, 9, "streambp", "stream:3"),  # host buffers and copies from the 9-layer schedule
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "seq_len", "num_layers", "method", "checkpoints"), CASES)
def test_two_shallow_runs_predict_the_full_depth_to_the_byte(model, seq_len, num_layers, method, checkpoints):
    """Every memory column, the peak phase and the key of the extrapolated row equal the full run's."""
    spec = RunSpec(
        model=model,
        method=method,
        seq_len=seq_len,
        dtype="bf16",
        num_layers=num_layers,
        settings=MethodSettings(chunk_size=128, logits_chunk_size=64, checkpoints=checkpoints),
        memory_limit=80 << 30,
    )
    full = estimate_point(spec, gpu_memory_bytes=80 << 30)
    extrapolated = estimate_point_by_depth(spec, gpu_memory_bytes=80 << 30)
    assert full.status == extrapolated.status == "ok"
    for column in ("weights_bytes", "grads_bytes", "baseline_bytes", "peak_allocated_bytes", "activation_peak_bytes",
                   "margin_bytes", "num_params", "num_layers", "peak_phase", "attention_kernel",
                   "host_pinned_peak_bytes", "transfer_bytes"):  # fmt: skip
        assert getattr(extrapolated, column) == getattr(full, column), column
    assert row_key(extrapolated) == row_key(full)  # the same point in a results file


@pytest.mark.slow  # one shallow and one full fake run of a streamed step: 9 s on 2 busy cores
@pytest.mark.parametrize("checkpoints", ["stream:2", "stream:4"])
def test_a_stream_placement_is_lifted_from_one_shallow_run_to_the_byte(checkpoints):
    """stream:N on 6 layers from the 2-layer run: the device's peak, the host buffers (the 6-layer
    schedule's N) and the copies equal the full-depth fake run's."""
    spec = RunSpec(
        model="tiny/qwen3", method="streambp", seq_len=192, dtype="bf16", num_layers=6,
        settings=MethodSettings(chunk_size=64, logits_chunk_size=64, checkpoints=checkpoints),
    )  # fmt: skip
    full = estimate_point(spec, gpu_memory_bytes=80 << 30)
    lifted = estimate_point_by_depth(spec, gpu_memory_bytes=80 << 30)
    for column in ("peak_allocated_bytes", "activation_peak_bytes", "peak_phase", "host_pinned_peak_bytes",
                   "transfer_bytes"):  # fmt: skip
        assert getattr(lifted, column) == getattr(full, column), column


def test_only_models_whose_layers_are_all_alike_are_extrapolated():
    """Depth extrapolation applies to uniform-layer models and not to Gemma's mixed sliding/global layers."""
    assert uniform_layers("Qwen/Qwen3-8B") and uniform_layers("meta-llama/Llama-3.1-8B")
    assert not uniform_layers("google/gemma-3-1b-pt")  # sliding and global layers


@pytest.mark.parametrize("method", ["official", "liger"])
def test_a_method_the_estimator_cannot_run_is_an_unsupported_row_at_any_depth(method):
    """A method that cannot run under fake tensors gives an unsupported row with its reason, not a TypeError."""
    spec = RunSpec(model="tiny/qwen3", method=method, seq_len=256, dtype="bf16", num_layers=8)
    row = estimate_point_by_depth(spec, gpu_memory_bytes=80 << 30)
    assert row.status == "unsupported" and row.error and row.num_layers == 8
