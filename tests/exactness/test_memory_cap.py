"""A memory cap above what the device has: the point runs at the device's capacity, records the cap
that applied and says so; plots and the report mark a cap that is not the paper's 80 GiB."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sbpbench.config import RunSpec
from sbpbench.measure.host_memory import total_ram_bytes
from sbpbench.records import ResultRow
from sbpbench.records.select import capacity_bytes, device_label, is_paper_capacity
from sbpbench.runner import point
from sbpbench.runner.isolated import cap_notice

GIB = 2**30
H100_TOTAL = 81559 * 2**20  # what nvidia-smi lists for an H100 80GB HBM3: 79.65 GiB


def test_a_cap_above_the_machines_ram_runs_capped_at_the_ram():
    """CPU: a 100 TB cap on tracked bytes is above any RAM here, so the point runs (ok) with the
    machine's RAM as its recorded cap, beside the 100 TB asked for."""
    row = point.measure_point(
        RunSpec(model="tiny/qwen3", method="bp", seq_len=64, warmup=0, repeats=0, memory_limit=10**14)
    )
    assert row.status == "ok", row.error
    assert row.memory_limit_bytes == 10**14
    assert row.memory_limit_effective_bytes == total_ram_bytes() < 10**14


@pytest.fixture
def cuda_stand_in(monkeypatch):
    """torch.cuda as an H100 would answer (start-up, device properties), recording the per-process
    fraction set; the model build stops the point right after the CUDA set-up."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=H100_TOTAL))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: calls.append((f, device)))
    monkeypatch.setattr(point, "start_cuda", lambda device: SimpleNamespace(idle_used_bytes=1, context_bytes=2))

    def no_gpu_past_here(*args, **kwargs):
        raise RuntimeError("stand-in: no model on a GPU here")

    monkeypatch.setattr(point, "build_step", no_gpu_past_here)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    return calls


def _cuda_point(memory_limit):
    spec = RunSpec(model="tiny/qwen3", method="bp", seq_len=64, device="cuda", memory_limit=memory_limit)
    row = point.measure_point(spec)
    assert "stand-in" in row.error  # it got past the CUDA set-up
    return row


def test_the_papers_80_gib_on_an_h100_runs_at_the_h100s_total(cuda_stand_in):
    """CUDA (stand-in): 80 GiB is above the H100's 79.65 GiB, so no fraction is set (the whole device)
    and the row records 79.65 GiB as the cap that applied (main raised here); 40 GiB sets the fraction
    40 / 79.65. The worker's allocator setting is recorded too."""
    row = _cuda_point(80 * GIB)
    assert (row.memory_limit_bytes, row.memory_limit_effective_bytes) == (80 * GIB, H100_TOTAL)
    assert cuda_stand_in == [] and row.cuda_alloc_conf == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert (row.nvml_idle_used_bytes, row.cuda_context_bytes) == (1, 2)
    row = _cuda_point(40 * GIB)
    assert row.memory_limit_effective_bytes == 40 * GIB
    assert cuda_stand_in == [(pytest.approx(40 * GIB / H100_TOTAL), torch.device("cuda:0"))]


def test_a_lowered_cap_is_said_in_one_line():
    """The parent's notice: asked, applied and where the difference comes from; none when the cap held."""
    gpu = ResultRow(device="cuda:0", device_name="NVIDIA H100 80GB HBM3")
    gpu.memory_limit_bytes, gpu.memory_limit_effective_bytes = 80 * GIB, H100_TOTAL
    notice = cap_notice(gpu)
    assert "\n" not in notice and "80.00 GiB" in notice and "79.65 GiB" in notice and "NVIDIA H100" in notice
    cpu = ResultRow(device="cpu", memory_limit_bytes=10**14, memory_limit_effective_bytes=8 * GIB)
    assert "this machine's RAM" in cap_notice(cpu)
    assert cap_notice(ResultRow(device="cpu", memory_limit_bytes=GIB, memory_limit_effective_bytes=GIB)) is None
    assert cap_notice(ResultRow(device="cpu")) is None


def _row(**values) -> dict:
    base = {"device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3", "device_total_memory_bytes": H100_TOTAL}
    return {"status": "ok", "memory_limit_bytes": None, "memory_limit_effective_bytes": None, **base, **values}


def test_plots_and_the_report_mark_a_cap_that_is_not_the_papers():
    """The label plots and the report print beside a row says when the cap that applied was lowered
    below the one asked for, and when a row compared with the paper's 80 GiB card had another
    capacity; its capacity is the cap that applied."""
    clamped = _row(memory_limit_bytes=80 * GIB, memory_limit_effective_bytes=H100_TOTAL)
    assert capacity_bytes(clamped) == H100_TOTAL and is_paper_capacity(clamped)
    assert device_label(clamped) == (
        "NVIDIA H100 80GB HBM3, limit 80 GiB capped at 79.6 (the device's), not the paper's 80 GiB"
    )
    assert device_label(_row()) == "NVIDIA H100 80GB HBM3 (79.6 GiB, not the paper's 80)"
    h200 = _row(device_name="NVIDIA H200", device_total_memory_bytes=143771 * 2**20, memory_limit_bytes=80 * GIB)
    assert device_label({**h200, "memory_limit_effective_bytes": 80 * GIB}) == "NVIDIA H200, limit 80 GiB"
    cpu = _row(device="cpu", device_name="AMD EPYC", memory_limit_bytes=10**14, memory_limit_effective_bytes=8 * GIB)
    assert device_label(cpu) == "AMD EPYC, limit 93132.3 GiB capped at 8 (the RAM's)"
