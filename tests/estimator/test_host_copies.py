"""Checkpoints offloaded to the host (save_on_cpu: ckpt-offload, and tiled and ulysses with
offload_checkpoints) in a GPU prediction: host bytes, not device bytes (methods/offload.py
ShapeOnlyCopies, under StepHooks.shapes_only). On fake CPU tensors save_on_cpu's copy is the tensor
itself, so without them the GPU peak held every layer's input, as ckpt's does."""

from __future__ import annotations

from sbpbench.config import point_specs
from sbpbench.models import load_config
from sbpbench.simulate.estimate import simulate

POINT = {"device": "cpu", "model": "tiny/qwen3", "seq_len": 2048, "dtype": "bf16", "batch_size": 1}


def _predicted(method: str, target: str):
    (spec,) = point_specs(POINT, [method], defaults_for="cuda")
    return simulate(spec, target=target)[0]


def test_offloaded_checkpoints_leave_the_gpu_peak_for_the_host():
    """At the peak (a layer's backward) ckpt holds every layer's input on the GPU and ckpt-offload on
    the host: the GPU peaks differ by exactly those inputs, which are ckpt-offload's host bytes, each
    copied out and back once."""
    config = load_config(POINT["model"])
    layer_input = POINT["batch_size"] * POINT["seq_len"] * config.hidden_size * 2  # (B, T, d) bf16: 512 B multiples
    inputs = config.num_hidden_layers * layer_input
    ckpt, offload = _predicted("ckpt", "cuda"), _predicted("ckpt-offload", "cuda")
    assert ckpt.peak_phase == offload.peak_phase
    assert ckpt.peak_allocated_bytes - offload.peak_allocated_bytes == inputs
    assert (offload.host_pinned_bytes, offload.transfer_bytes) == (inputs, 2 * inputs)
    assert (ckpt.host_pinned_bytes, ckpt.transfer_bytes) == (0, 0)


def test_on_a_cpu_target_the_copies_stay_in_the_one_memory():
    """`--target cpu` reproduces the tracker, which counts a CPU run's host copies with the rest: no
    host bytes apart, the peak as save_on_cpu leaves it."""
    offload = _predicted("ckpt-offload", "cpu")
    assert (offload.host_pinned_bytes, offload.transfer_bytes) == (0, 0)
