"""Device names are resolved to an indexed CUDA device once, where the config is built, so no
torch.cuda call ever gets the index-less "cuda" (which torch.cuda.set_device rejects). Run on a
CPU machine against a stand-in for torch.cuda."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sbpbench.config import ConfigError, RunSpec, point_specs, resolve_device
from sbpbench.measure import cuda_memory
from sbpbench.runner import point


def _no_cuda_init():
    raise AssertionError("resolving a device initialised CUDA (current_device) in the parent")


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda as on a machine with two GPUs, failing if anything asks for the current device
    (which initialises CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", _no_cuda_init)


def test_auto_and_cuda_resolve_to_an_indexed_device(two_gpus):
    """auto and cuda name the first visible GPU with its index (without starting CUDA); cuda:N is
    kept when it exists."""
    assert resolve_device("auto") == "cuda:0"
    assert resolve_device("cuda") == "cuda:0"
    assert resolve_device("CUDA:0") == "cuda:0"
    assert resolve_device("cpu") == "cpu"


def test_a_missing_gpu_index_is_refused(two_gpus):
    """cuda:2 on a two-GPU machine is a one-line error that lists what exists."""
    with pytest.raises(ConfigError, match=r"cuda:2 does not exist: 2 CUDA device\(s\) visible"):
        resolve_device("cuda:2")


def test_without_a_gpu_auto_is_cpu_and_cuda_is_refused():
    """On this CPU machine: auto means cpu, and asking for cuda says what to do."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ConfigError, match="no CUDA GPU is visible; use cpu"):
        resolve_device("cuda")


def test_every_spec_holds_an_indexed_device(two_gpus):
    """However a spec is built (the config builder, RunSpec itself, the worker's JSON), its device
    is indexed, and the row records the indexed name."""
    (built,) = point_specs({"device": "cuda", "model": "tiny/qwen3"}, ["bp"])
    direct = RunSpec(model="tiny/qwen3", method="bp", seq_len=64, device="cuda")
    assert built.device == direct.device == RunSpec.from_json(direct.to_json()).device == "cuda:0"
    assert point_specs({"model": "tiny/qwen3"}, ["bp"])[0].device == "cuda:0"  # the default, auto


class _StandInCuda:
    """The torch.cuda calls start_cuda makes, refusing an index-less device as the real one does."""

    def __init__(self):
        self.devices = []

    def _check(self, device):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        self.devices.append(str(device))

    def set_device(self, device):
        self._check(device)

    def synchronize(self, device=None):
        self._check(device)

    def memory_reserved(self, device=None):
        self._check(device)
        return 0


def test_the_worker_starts_cuda_on_the_indexed_device(two_gpus, monkeypatch):
    """measure_point's CUDA start-up (start_cuda) runs against the stand-in without the
    index-less-device error that every `sbp run` point hit on an H100 before the fix."""
    cuda = _StandInCuda()
    stand_in = SimpleNamespace(cuda=cuda, ones=lambda *shape, device=None: torch.ones(*shape))
    monkeypatch.setattr(cuda_memory, "torch", stand_in)
    monkeypatch.setattr(cuda_memory, "nvml_handle", lambda device: None)
    started = []

    def start(device):
        started.append(device)
        cuda_memory.start_cuda(device)
        raise RuntimeError("stop after start-up")  # the rest needs a real GPU

    monkeypatch.setattr(point, "start_cuda", start)
    row = point.measure_point(RunSpec(model="tiny/qwen3", method="bp", seq_len=64, device="cuda"))
    assert row.error == "RuntimeError: stop after start-up"  # start-up itself raised nothing
    assert [str(d) for d in started] == ["cuda:0"] and row.device == "cuda:0"
    assert cuda.devices and all(d == "cuda:0" for d in cuda.devices)


def test_the_stand_in_fails_as_the_real_call_did_on_an_index_less_device(monkeypatch):
    """The guard above can fail: start_cuda given "cuda" raises the H100's error."""
    stand_in = SimpleNamespace(cuda=_StandInCuda(), ones=lambda *shape, device=None: torch.ones(*shape))
    monkeypatch.setattr(cuda_memory, "torch", stand_in)
    monkeypatch.setattr(cuda_memory, "nvml_handle", lambda device: None)
    with pytest.raises(ValueError, match="specified index"):
        cuda_memory.start_cuda(torch.device("cuda"))
