"""Long GPU points made affordable, checked on a CPU: a memory-only probe runs one step, a long
step says where it is (layer i of L), and the FLOPs of a step split by phase."""

from __future__ import annotations

import io
import itertools

import pytest
import torch

from sbpbench.config import point_specs
from sbpbench.core import stream_backward
from sbpbench.measure.progress import PROGRESS_PREFIX, StepProgress
from sbpbench.records import ResultRow
from sbpbench.runner import point

from .conftest import padded_batch, tiny_model


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
    """The worker's CUDA memory measurement of a probe spec runs the step once (against a stand-in
    for torch.cuda's peak counters)."""
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
    for name in ("memory_allocated", "max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: 0)
    monkeypatch.setattr(point, "nvml_handle", lambda device: None)
    (spec,) = point_specs({"model": "tiny/qwen3", "repeats": 0}, ["streambp"])
    step = _CountingStep()
    point._measure_cuda(spec, step, ResultRow(), torch.device("cuda:0"), step.prepare)
    assert step.runs == 1


def test_stream_backward_reports_every_layer():
    """core calls progress(0, L) after the checkpoint pass and head, then (i, L) per layer."""
    model = tiny_model("tiny/qwen3", torch.float32)
    batch = padded_batch(model, batch_size=1, seq_len=16)
    calls = []
    stream_backward(model, batch.input_ids, batch.labels, chunk_size=8, progress=lambda *a: calls.append(a))
    layers = model.config.num_hidden_layers
    assert calls == [(i, layers) for i in range(layers + 1)]


def test_step_progress_is_silent_for_short_steps():
    """Nothing is printed before after_s; afterwards one line per call, synchronised first."""
    ticks = itertools.count()
    stream, synced = io.StringIO(), []
    progress = StepProgress(
        "streambp T=9", after_s=2, stream=stream, clock=lambda: next(ticks), synchronize=lambda: synced.append(1)
    )
    progress.restart()  # t=1
    progress(0, 2)  # t=2: 1 s in
    progress(1, 2)  # t=3: 2 s in, then 3 s after the sync: printed
    lines = stream.getvalue().splitlines()
    assert lines == [f"{PROGRESS_PREFIX} streambp T=9: layer 1 of 2 backward done, 3.0 s"] and synced == [1]


def test_the_worker_prints_progress_of_slow_steps(monkeypatch, capsys):
    """A measured streambp point prints layer lines to stderr once a step is past the threshold
    (here 0 s)."""
    monkeypatch.setattr(point, "StepProgress", lambda label, **kw: StepProgress(label, **{**kw, "after_s": 0}))
    (spec,) = point_specs({"model": "tiny/qwen3", "seq_len": 32, "repeats": 0, "device": "cpu"}, ["streambp"])
    row = point.measure_point(spec)
    assert row.status == "ok", row.error
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(PROGRESS_PREFIX)]
    assert len(lines) == row.num_layers + 1 and "layer 2 of 2 backward done" in lines[-1]
