"""`sbp env` and capture_environment: every field filled, git provenance, and no CUDA initialisation."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch
import typer
from typer.testing import CliRunner

from sbpbench.cli.env_cmd import env
from sbpbench.measure import environment
from sbpbench.measure.environment import Environment, capture_environment, git_state

app = typer.Typer()
app.command()(env)  # a single command: Typer runs it without a subcommand name
runner = CliRunner()
FIELDS = [f.name for f in dataclasses.fields(Environment)]
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git executable")


@pytest.fixture
def no_cuda_init(monkeypatch):
    """Make every torch.cuda entry point that could create a CUDA context fail the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("torch.cuda was touched: the parent of a GPU measurement must not initialise CUDA")

    for name in ("init", "_lazy_init", "is_available", "device_count", "get_device_name", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    monkeypatch.setattr(torch.cuda, "mem_get_info", forbidden)


def test_cpu_environment_fills_every_field():
    """capture_environment("cpu") gives a non-empty string or a positive int for every field."""
    values = capture_environment("cpu").as_dict()
    assert list(values) == FIELDS
    for name, value in values.items():
        if isinstance(value, int):
            assert value > 0, name
        else:
            assert isinstance(value, str) and value.strip(), name
    assert values["device"] == "cpu" and values["device_total_memory_bytes"] == values["ram_bytes"]
    assert values["torch_version"] == torch.__version__


@needs_git
def test_git_commit_of_this_checkout():
    """In a git checkout the commit is a full 40-hex hash and dirty is "true" or "false"."""
    env_ = capture_environment("cpu")
    assert re.fullmatch(r"[0-9a-f]{40}", env_.git_commit), env_.git_commit
    assert env_.git_dirty in ("true", "false")


def test_git_unknown_outside_a_work_tree(tmp_path, monkeypatch):
    """A package directory outside any git work tree (an installed wheel) gives ("unknown", "unknown")."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # never find a repository above tmp_path
    assert git_state(tmp_path) == ("unknown", "unknown")


@needs_git
def test_git_unknown_for_an_untracked_package_inside_another_repo(tmp_path, monkeypatch):
    """A package inside some other repository that does not track it (a venv kept there) gives "unknown"."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    package = tmp_path / ".venv" / "site-packages" / "sbpbench"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    assert git_state(package) == ("unknown", "unknown")


def test_capture_does_not_initialise_cuda(no_cuda_init):
    """Capturing for cpu, cuda and auto never calls into torch.cuda, so no CUDA context is created."""
    for device in ("cpu", "cuda", "cuda:1", "auto"):
        capture_environment(device)
    assert not torch.cuda.is_initialized()


def test_unknown_device_is_a_user_error():
    """--device tpu exits 2 with a one-line message naming the accepted devices."""
    result = runner.invoke(app, ["--device", "tpu"])
    assert result.exit_code == 2 and "cpu, cuda, cuda:N or auto" in result.output


def test_json_output_parses(no_cuda_init):
    """--json prints one JSON object with every field and nothing else on stdout."""
    result = runner.invoke(app, ["--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    values = json.loads(result.stdout)
    assert list(values) == FIELDS and values["torch_version"] == torch.__version__


def test_table_shows_versions_and_gib(no_cuda_init):
    """The table names the torch version and shows RAM as GiB with the raw bytes beside it."""
    result = runner.invoke(app, [])
    assert result.exit_code == 0, result.output
    assert torch.__version__ in result.output
    assert re.search(r"\d+\.\d GiB", result.output) and " B)" in result.output


class FakeNVMLError(Exception):
    pass


def fake_pynvml(uuids: dict[str, int]):
    """A pynvml with 3 GPUs "GPU n" of (n + 1) GiB, returning bytes like older nvidia-ml-py releases."""
    return SimpleNamespace(
        NVMLError=FakeNVMLError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: b"570.1",
        nvmlDeviceGetCount=lambda: 3,
        nvmlDeviceGetHandleByIndex=lambda i: i if i < 3 else _raise(FakeNVMLError("bad index")),
        nvmlDeviceGetHandleByUUID=lambda u: uuids[u] if u in uuids else _raise(FakeNVMLError("bad uuid")),
        nvmlDeviceGetName=lambda i: f"GPU {i}".encode(),
        nvmlDeviceGetMemoryInfo=lambda i: SimpleNamespace(total=(i + 1) * 2**30),
    )


def _raise(error):
    raise error


@pytest.mark.parametrize(
    ("visible", "device", "expected"),
    [
        (None, "cuda", "GPU 0"),
        (None, "cuda:2", "GPU 2"),
        ("2,0", "cuda:1", "GPU 0"),
        ("2,0", "cuda", "GPU 2"),
        ("GPU-b,GPU-a", "cuda:1", "GPU 1"),
        ("1,-1,2", "cuda:1", None),  # CUDA stops reading at -1: only one device is visible
        (None, "cuda:5", None),
    ],
)
def test_gpu_facts_follow_cuda_visible_devices(monkeypatch, no_cuda_init, visible, device, expected):
    """A logical cuda:N maps through CUDA_VISIBLE_DEVICES (indices or UUIDs) to the NVML device, bytes decoded."""
    monkeypatch.setattr(environment, "pynvml", fake_pynvml({"GPU-a": 1, "GPU-b": 2}))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    env_ = capture_environment(device)
    assert env_.driver_version == "570.1"
    if expected is None:
        assert env_.device_name.startswith("unknown") and env_.device_total_memory_bytes == 0
    else:
        index = int(expected.split()[1])
        assert (env_.device_name, env_.device_total_memory_bytes) == (expected, (index + 1) * 2**30)


@pytest.mark.parametrize(
    ("visible", "cuda", "expected"), [(None, "12.8", "cuda"), ("", "12.8", "cpu"), (None, None, "cpu")]
)
def test_auto_device(monkeypatch, no_cuda_init, visible, cuda, expected):
    """auto is cuda only when NVML sees a visible GPU and torch was built with CUDA."""
    monkeypatch.setattr(environment, "pynvml", fake_pynvml({}))
    monkeypatch.setattr(torch.version, "cuda", cuda)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert environment.auto_device() == expected


def test_no_nvidia_driver(monkeypatch):
    """Without the NVML library the driver reads "n/a (no NVIDIA driver)" and cuda devices are unknown."""
    monkeypatch.setattr(environment, "pynvml", None)
    env_ = capture_environment("cuda")
    assert env_.driver_version == "n/a (no NVIDIA driver)" and env_.device_name.startswith("unknown")


@pytest.mark.parametrize(("visible", "expected"), [(None, 3), ("2,0", 2), ("0,-1,2", 1), ("", 0), ("0,1,2,3", 3)])
def test_visible_gpu_count_follows_cuda_visible_devices(monkeypatch, no_cuda_init, visible, expected):
    """NVML's GPU count, capped by CUDA_VISIBLE_DEVICES as CUDA reads it, without touching torch.cuda."""
    monkeypatch.setattr(environment, "pynvml", fake_pynvml({}))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert environment.visible_gpu_count() == expected
    monkeypatch.setattr(environment, "pynvml", None)  # no NVML library: none visible
    assert environment.visible_gpu_count() == 0
