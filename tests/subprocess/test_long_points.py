"""Long GPU points made affordable, checked on a CPU: a memory-only probe runs one step, a long
step says where it is (layer i of L), and the FLOPs of a step split by phase."""

from __future__ import annotations

import io
import itertools

import pytest
import torch

from sbpbench.config import point_specs
from sbpbench.measure.progress import PROGRESS_PREFIX, StepProgress
from sbpbench.records import ResultRow
from sbpbench.runner import point

from ..conftest import padded_batch, streamed, tiny_model


def test_memory_only_points_default_to_no_warmup():
    """repeats 0 (a probe) means one step: warm-up 0 unless asked; timed points keep warm-up 1."""
    (probe,) = point_specs({"model": "tiny/qwen3", "repeats": 0}, ["streambp"])
    (asked,) = point_specs({"model": "tiny/qwen3", "repeats": 0, "warmup": 2}, ["streambp"])
    (timed,) = point_specs({"model": "tiny/qwen3"}, ["streambp"])
    assert (probe.warmup, asked.warmup, timed.warmup) == (0, 2, 1)


class _CountingStep:
    def __init__(self):
        self.runs = 0

    def prepare(self):
        pass

    def run(self):
        self.runs += 1
        return torch.tensor(1.0)


def test_a_cuda_probe_runs_one_step(monkeypatch):
    """The worker's CUDA memory measurement of a probe spec runs the step once, named the memory
    step; with a warm-up, the warm-up comes first under its own name (against a stand-in for
    torch.cuda's peak counters)."""
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
    for name in ("memory_allocated", "max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: 0)
    monkeypatch.setattr(point, "nvml_handle", lambda device: None)
    for warmup, expected in ((0, ["memory step"]), (1, ["warm-up 1 of 1", "memory step"])):
        (spec,) = point_specs({"model": "tiny/qwen3", "repeats": 0, "warmup": warmup}, ["streambp"])
        step, names = _CountingStep(), []
        point._measure_cuda(
            spec, step, ResultRow(), torch.device("cuda:0"), lambda name, names=names: names.append(name)
        )
        assert step.runs == 1 + warmup and names == expected


def test_stream_backward_reports_every_layer():
    """core calls progress(0, L) after the checkpoint pass and head, then (i, L) per layer."""
    model = tiny_model("tiny/qwen3", torch.float32)
    batch = padded_batch(model, batch_size=1, seq_len=16)
    calls = []
    streamed(model, batch.input_ids, batch.labels, chunk_size=8, progress=lambda *a: calls.append(a))
    layers = model.config.num_hidden_layers
    assert calls == [(i, layers) for i in range(layers + 1)]


def test_step_progress_is_silent_for_short_steps():
    """Nothing is printed before after_s; afterwards one line per call, synchronised first."""
    ticks = itertools.count()
    stream, synced = io.StringIO(), []
    progress = StepProgress(
        "streambp T=9", after_s=2, stream=stream, clock=lambda: next(ticks), synchronize=lambda: synced.append(1)
    )
    progress.restart("timed step 1 of 3")  # t=1
    progress(0, 2)  # t=2: 1 s in
    progress(1, 2)  # t=3: 2 s in, then 3 s after the sync: printed
    lines = stream.getvalue().splitlines()
    assert lines == [f"{PROGRESS_PREFIX} streambp T=9: timed step 1 of 3, layer 1 of 2 backward done, 3.0 s"]
    assert synced == [1]


def test_the_worker_prints_progress_of_slow_steps(monkeypatch, capsys):
    """A measured streambp point prints layer lines to stderr once a step is past the threshold
    (here 0 s)."""
    monkeypatch.setattr(point, "StepProgress", lambda label, **kw: StepProgress(label, **{**kw, "after_s": 0}))
    (spec,) = point_specs({"model": "tiny/qwen3", "seq_len": 32, "repeats": 0, "device": "cpu"}, ["streambp"])
    row = point.measure_point(spec)
    assert row.status == "ok", row.error
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(PROGRESS_PREFIX)]
    assert len(lines) == row.num_layers + 1 and "layer 2 of 2 backward done" in lines[-1]


def test_each_step_of_a_point_has_its_own_progress_label(monkeypatch, capsys):
    """A point of 1 warm-up and 2 timed steps prints each step's layer lines under its own label
    (memory step, warm-up 1 of 1, timed step i of 2), not five times the same text."""
    monkeypatch.setattr(point, "StepProgress", lambda label, **kw: StepProgress(label, **{**kw, "after_s": 0}))
    settings = {"model": "tiny/qwen3", "seq_len": 32, "warmup": 1, "repeats": 2, "device": "cpu"}
    (spec,) = point_specs(settings, ["streambp"])
    row = point.measure_point(spec)
    assert row.status == "ok", row.error
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(PROGRESS_PREFIX)]
    steps = [line.split(": ", 2)[2].split(",")[0] for line in lines]
    expected = ["memory step", "warm-up 1 of 1", "timed step 1 of 2", "timed step 2 of 2"]  # the CPU's order
    assert steps == [step for step in expected for _ in range(row.num_layers + 1)]


def test_phase_flops_of_bp_add_up_to_the_model_flops():
    """bp executes exactly the model FLOPs (measure/flops.py training_flops); ckpt adds one
    forward of the layers, streambp that plus the K/V projections of every position."""
    from sbpbench.measure.flops import phase_flops, training_flops

    model = tiny_model("tiny/qwen3", torch.float32)
    totals = {
        method: sum(m + a for m, a in phase_flops(model.config, method=method, batch_size=2, seq_len=40).values())
        for method in ("bp", "ckpt", "streambp")
    }
    forward = phase_flops(model.config, method="bp", batch_size=2, seq_len=40)["forward"]
    c = model.config
    kv_projections = 2 * 2 * c.hidden_size * c.num_key_value_heads * c.head_dim * 2 * 40 * c.num_hidden_layers
    assert totals["bp"] == pytest.approx(training_flops(model, batch_size=2, seq_len=40), rel=1e-12)
    assert totals["ckpt"] == pytest.approx(totals["bp"] + sum(forward), rel=1e-12)
    assert totals["streambp"] == pytest.approx(totals["ckpt"] + kv_projections, rel=1e-12)


def test_attention_dominates_a_qwen3_8b_step_at_100k():
    """The breakdown the issue asks for: at T=100k, two thirds of a Qwen3-8B StreamBP step's
    FLOPs are attention, three quarters of all of it in the layer backward; the head is ~2%."""
    from sbpbench.measure.flops import phase_flops, phase_flops_markdown
    from sbpbench.models import load_config

    config = load_config("Qwen/Qwen3-8B")
    phases = phase_flops(config, method="streambp", batch_size=1, seq_len=100_000)
    total = sum(m + a for m, a in phases.values())
    assert sum(a for _, a in phases.values()) / total == pytest.approx(0.66, abs=0.02)
    layer_backward = sum(sum(phases[name]) for name in ("K/V capture", "chunk forward", "chunk backward"))
    assert layer_backward / total == pytest.approx(0.74, abs=0.02)
    assert sum(phases["head"]) / total < 0.03
    table = phase_flops_markdown(
        config, model="Qwen/Qwen3-8B", method="streambp", batch_size=1, seq_len=100_000, tflops_per_s=400
    )
    assert "| chunk backward |" in table and "| total |" in table
