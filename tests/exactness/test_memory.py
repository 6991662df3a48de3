"""Activation memory measured by the live-tensor tracker (deterministic on CPU)."""

from __future__ import annotations

import pytest
import torch

from sbpbench.measure.tensor_tracker import LiveTensorTracker
from sbpbench.methods import MethodSettings, run_method

from ..conftest import padded_batch, tiny_model

SEQ_LEN = 4096
VOCAB = 32000  # a realistic vocabulary: full logits are what standard BP and ckpt pay for

pytestmark = pytest.mark.slow  # T = 4096 steps with a 32k vocabulary: 5-15 s each on 2 cores


def _tracked_step(model, batch, method, settings):
    """Steady-state protocol: gradients already resident, so the peak is activations only."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with LiveTensorTracker() as tracker:
        run_method(method, model, batch, settings)
    return tracker


def test_streambp_activation_peak_is_a_fraction_of_ckpt():
    """At T=4096, V=32000 streambp's tracked peak above weights+grads is <= 0.2x ckpt's, and no
    tensor it allocates has T*T or T*V elements."""
    model = tiny_model("tiny/qwen3", torch.float32, vocab_size=VOCAB)
    batch = padded_batch(model, batch_size=1, seq_len=SEQ_LEN, lengths="paper")
    settings = MethodSettings()  # the paper's partitions: 500 positions per layer chunk, 100 per logits chunk
    stream = _tracked_step(model, batch, "streambp", settings)
    ckpt = _tracked_step(model, batch, "ckpt", settings)
    ratio = stream.peak_bytes / ckpt.peak_bytes
    print(f"tracked activation peak: streambp {stream.peak_bytes:,} B, ckpt {ckpt.peak_bytes:,} B, ratio {ratio:.4f}")
    assert ratio <= 0.2
    assert stream.largest.numel < SEQ_LEN * SEQ_LEN, stream.largest
    assert stream.largest.numel < SEQ_LEN * VOCAB, stream.largest
    assert ckpt.largest.numel >= SEQ_LEN * VOCAB // 2  # the tracker does see full logits when they exist


def test_no_whole_sequence_layer_intermediate():
    """Forward and backward run each layer in chunks: no tensor of T x intermediate_size elements
    (the MLP's hidden activations over the whole sequence) is ever allocated, unlike in ckpt."""
    seq_len, intermediate, chunk = 2048, 1024, 256
    model = tiny_model("tiny/qwen3", torch.float32, intermediate_size=intermediate)
    batch = padded_batch(model, batch_size=1, seq_len=seq_len, lengths="paper")
    settings = MethodSettings(chunk_size=chunk, logits_chunk_size=chunk)
    stream = _tracked_step(model, batch, "streambp", settings)
    ckpt = _tracked_step(model, batch, "ckpt", settings)
    assert stream.largest.numel < seq_len * intermediate, stream.largest
    assert ckpt.largest.numel >= seq_len * intermediate, ckpt.largest


def _objective_peaks(objective: str, batch_size: int, seq_len: int) -> dict[str, int]:
    from sbpbench.data import make_batch

    model = tiny_model("tiny/qwen3", torch.float32, vocab_size=VOCAB)
    batch = make_batch(objective, batch_size=batch_size, seq_len=seq_len, vocab_size=VOCAB, prompt_len=seq_len // 8)
    settings = MethodSettings()
    return {m: _tracked_step(model, batch, m, settings).peak_bytes for m in ("ckpt", "streambp")}


def test_grpo_and_dpo_streambp_peak_is_a_fraction_of_ckpt():
    """GRPO (a group of 2) and DPO (one pair) at T=1024, V=32000: streambp's tracked activation peak
    is <= 0.1x ckpt's (ckpt holds the full logits, their fp32 log-softmax and its gradient)."""
    for objective, batch_size in (("grpo", 2), ("dpo", 2)):
        peaks = _objective_peaks(objective, batch_size, 1024)
        ratio = peaks["streambp"] / peaks["ckpt"]
        print(f"{objective}: streambp {peaks['streambp']:,} B, ckpt {peaks['ckpt']:,} B, ratio {ratio:.4f}")
        assert ratio <= 0.1
