"""Measurement building blocks: FLOP count, byte sizes, timing, peak RSS, the tracker's limit."""

from __future__ import annotations

import re

import pytest
import torch

from sbpbench.measure.flops import mean_attended_keys, training_flops
from sbpbench.measure.host_memory import peak_rss_bytes, reset_peak_rss
from sbpbench.measure.tensor_tracker import LiveTensorTracker, TrackedOutOfMemoryError
from sbpbench.measure.timing import time_steps
from sbpbench.measure.units import GIB, gib, parse_bytes
from sbpbench.models import build_model


def test_mean_attended_keys_counts_the_causal_triangle_and_the_window():
    """Query i sees i+1 keys (at most the window): T=4 -> (1+2+3+4)/4; window 2 -> (1+2+2+2)/4."""
    assert mean_attended_keys(4) == 2.5
    assert mean_attended_keys(4, window=2) == 7 / 4
    assert mean_attended_keys(4, window=100) == 2.5


def test_training_flops_is_six_n_plus_half_of_palm_attention():
    """For a full-attention model: 6 * matmul weights * tokens + 12 * L * H * Q * tokens * (T+1)/2."""
    model = build_model("tiny/qwen3", device="meta")
    config = model.config
    d, heads, kv, q, inter = 64, 4, 2, 16, 128
    per_layer = d * heads * q + 2 * d * kv * q + heads * q * d + 3 * d * inter  # q, k, v, o, gate/up/down
    linear = config.num_hidden_layers * per_layer + 512 * d  # + lm_head (tied: the embedding's matrix, used twice)
    B, T = 2, 10
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * B * T * (T + 1) / 2
    assert training_flops(model, batch_size=B, seq_len=T) == pytest.approx(6 * linear * B * T + attention, rel=1e-12)


def test_training_flops_counts_sliding_layers_by_their_window():
    """Gemma-3's sliding layer sees at most `sliding_window` keys: fewer FLOPs than all-full attention."""
    sliding = build_model("tiny/gemma3", device="meta")
    full = build_model("tiny/gemma3", device="meta", layer_types=["full_attention", "full_attention"])
    assert training_flops(sliding, batch_size=1, seq_len=64) < training_flops(full, batch_size=1, seq_len=64)
    assert training_flops(sliding, batch_size=1, seq_len=4) == training_flops(full, batch_size=1, seq_len=4)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * GIB), ("80GB", 80 * 10**9), ("512 MiB", 512 * 2**20), ("1e6B", 10**6), ("1.5gib", 3 * GIB // 2)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(("text", "advice"), [("80", "write 80GiB (2^30 bytes) or 80GB"), ("1e9", "write 1e9B")])
def test_a_size_without_a_unit_is_refused_not_read_as_bytes(text, advice):
    """ "80" is not 80 bytes: the error names the value and says which unit to add."""
    with pytest.raises(ValueError, match=rf"--gpu-memory '{text}' has no unit: {re.escape(advice)}"):
        parse_bytes(text, what="--gpu-memory")


@pytest.mark.parametrize("text", ["", "80 GiBs", "-1GiB", "0GiB", "lots"])
def test_parse_bytes_refuses_what_it_cannot_read(text):
    with pytest.raises(ValueError, match="80GiB"):
        parse_bytes(text)


def test_gib_display():
    assert gib(3 * GIB // 2) == "1.50" and gib(None) == "-"


def test_time_steps_keeps_setup_and_sync_in_order():
    """before_each runs outside the clock; synchronize brackets each timed step; median of repeats."""
    calls = []
    stats = time_steps(
        lambda: calls.append("step"),
        repeats=3,
        synchronize=lambda: calls.append("sync"),
        before_each=lambda: calls.append("prepare"),
    )
    assert calls == ["prepare", "sync", "step", "sync"] * 3
    assert len(stats.times_s) == 3 and stats.min_s <= stats.median_s <= stats.max_s
    with pytest.raises(ValueError):
        time_steps(lambda: None, repeats=0)


def test_peak_rss_is_per_region():
    """After a reset the peak follows a 256 MiB buffer touched inside the region."""
    reset_peak_rss()
    before = peak_rss_bytes()
    buffer = bytearray(256 * 2**20)  # zero-filled, so every page is touched
    after = peak_rss_bytes()
    del buffer
    assert after - before >= 200 * 2**20


def test_tracker_limit_raises_an_out_of_memory_error():
    """Going over limit_bytes raises TrackedOutOfMemoryError; under it nothing happens."""
    with LiveTensorTracker(limit_bytes=4096) as tracker:
        torch.ones(256)  # 1 KiB
        with pytest.raises(TrackedOutOfMemoryError, match="over the limit"):
            torch.ones(2048)  # 8 KiB
    assert tracker.peak_bytes >= 8192


def test_lora_training_flops_skip_frozen_weight_gradients():
    """With every base weight frozen the dense term is 4N + 2 N_trainable instead of 6N."""
    model = build_model("tiny/qwen3", device="meta")
    full = training_flops(model, batch_size=1, seq_len=8)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    model.requires_grad_(False)
    assert full - training_flops(model, batch_size=1, seq_len=8) == 2 * linear * 8
