"""The machine, driver and versions behind a result: provenance for every result row and for `sbp env`.

The GPU is read through NVML (`pynvml`, from nvidia-ml-py), never through `torch.cuda`: the parent process of a
GPU measurement must not create a CUDA context, which would hold GPU memory the measured child process then lacks.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import re
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from .. import __version__

try:
    import pynvml
except ImportError:  # nvidia-ml-py is a dependency; a stripped install still gets a report
    pynvml = None

NO_DRIVER = "n/a (no NVIDIA driver)"
CPU_ONLY_TORCH = "n/a (CPU-only torch build)"
UNKNOWN = "unknown"
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the sbpbench package directory
_DEVICE = re.compile(r"cpu|cuda(?::(\d+))?")


@dataclass(frozen=True, kw_only=True)
class Environment:
    """Where and with what a result was produced. Sizes in bytes; 0 means the size could not be read."""

    host: str
    device: str  # as asked for: "cpu", "cuda" or "cuda:N"
    device_name: str  # GPU name from NVML, or the CPU model name for "cpu"
    device_total_memory_bytes: int  # GPU total memory from NVML, or host RAM for "cpu"
    driver_version: str  # NVIDIA driver, or NO_DRIVER
    cuda_version: str  # CUDA torch was built with, or CPU_ONLY_TORCH
    torch_version: str
    transformers_version: str
    sbpbench_version: str
    python_version: str
    cpu_name: str
    num_cpus: int
    ram_bytes: int
    git_commit: str  # full hash of the sbpbench source checkout, or "unknown" (installed wheel, no git)
    git_dirty: str  # "true", "false" or "unknown"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def capture_environment(device: str = "cpu") -> Environment:
    """Describe this machine for `device` ("cpu", "cuda", "cuda:N" or "auto"), without initialising CUDA."""
    if device == "auto":
        device = auto_device()
    index = gpu_index(device)
    cpu_name, ram_bytes = _cpu_name(), _ram_bytes()
    driver, gpu = NO_DRIVER, None
    with _nvml() as ok:
        if ok:
            driver = _nvml_or_none(pynvml.nvmlSystemGetDriverVersion) or NO_DRIVER
            gpu = _gpu_name_and_memory(index) if index is not None else None
    if index is None:
        device_name, device_memory = cpu_name, ram_bytes
    else:
        device_name, device_memory = gpu or (f"{UNKNOWN} (NVML sees no {device})", 0)
    commit, dirty = source_git_state()
    return Environment(
        host=socket.gethostname(),
        device=device,
        device_name=device_name,
        device_total_memory_bytes=device_memory,
        driver_version=driver,
        cuda_version=torch.version.cuda or CPU_ONLY_TORCH,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        sbpbench_version=__version__,
        python_version=platform.python_version(),
        cpu_name=cpu_name,
        num_cpus=os.cpu_count() or 0,
        ram_bytes=ram_bytes,
        git_commit=commit,
        git_dirty=dirty,
    )


def auto_device() -> str:
    """Return "cuda" when NVML sees a visible GPU and torch was built with CUDA, else "cpu"."""
    if torch.version.cuda is None:
        return "cpu"
    return "cuda" if visible_gpu_count() > 0 else "cpu"


def visible_gpu_count() -> int:
    """The GPUs a CUDA process here would see: NVML's count, capped by CUDA_VISIBLE_DEVICES (counted as
    CUDA reads it); 0 without NVML or a driver. Creates no CUDA context."""
    with _nvml() as ok:
        count = (_nvml_or_none(pynvml.nvmlDeviceGetCount) or 0) if ok else 0
    visible = _visible_devices()
    return count if visible is None else min(count, len(visible))


def gpu_index(device: str) -> int | None:
    """The logical CUDA index `device` names ("cuda" is 0), None for "cpu"; ValueError for anything else."""
    match = _DEVICE.fullmatch(device)
    if match is None:
        raise ValueError(f"unknown device {device!r}: use cpu, cuda, cuda:N or auto")
    return None if device == "cpu" else int(match.group(1) or 0)


# --- GPU, through NVML -------------------------------------------------------------------------------------------


@contextmanager
def _nvml() -> Iterator[bool]:
    """NVML initialised for the block; yields False when the library or the driver is missing."""
    ok = pynvml is not None
    if ok:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:
            ok = False
    try:
        yield ok
    finally:
        if ok:
            pynvml.nvmlShutdown()


def _nvml_or_none(call, *args):
    """call(*args) with bytes decoded (older pynvml returns bytes), or None on an NVML error."""
    try:
        value = call(*args)
    except pynvml.NVMLError:
        return None
    return value.decode() if isinstance(value, bytes) else value


def _visible_devices() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES read as CUDA reads it (entries up to the first invalid one), None when unset."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    entries = []
    for entry in (e.strip() for e in value.split(",")):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break  # "-1", "" and junk end the list, as in CUDA
        entries.append(entry)
    return entries


def _gpu_name_and_memory(index: int) -> tuple[str, int] | None:
    """Name and total bytes of logical CUDA device `index`, or None when NVML cannot find it.

    Logical indices go through CUDA_VISIBLE_DEVICES (physical indices or UUIDs). NVML numbers GPUs in PCI bus
    order; CUDA does too only with CUDA_DEVICE_ORDER=PCI_BUS_ID, so on a box mixing GPU models the two can differ.
    """
    visible = _visible_devices()
    if visible is None:
        handle = _nvml_or_none(pynvml.nvmlDeviceGetHandleByIndex, index)
    elif index >= len(visible):
        return None
    elif visible[index].isdigit():
        handle = _nvml_or_none(pynvml.nvmlDeviceGetHandleByIndex, int(visible[index]))
    else:
        handle = _nvml_or_none(pynvml.nvmlDeviceGetHandleByUUID, visible[index])
    if handle is None:
        return None
    name = _nvml_or_none(pynvml.nvmlDeviceGetName, handle)
    memory = _nvml_or_none(pynvml.nvmlDeviceGetMemoryInfo, handle)
    if name is None and memory is None:
        return None
    return name or UNKNOWN, int(memory.total) if memory is not None else 0


# --- CPU and RAM -------------------------------------------------------------------------------------------------


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or UNKNOWN


def _ram_bytes() -> int:
    """Physical RAM of the host (a container's memory limit is not applied), 0 when the OS will not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


# --- git ---------------------------------------------------------------------------------------------------------


def git_state(directory: Path) -> tuple[str, str]:
    """(commit, dirty) of the git checkout that tracks `directory`; ("unknown", "unknown") when none does.

    "None does" covers no git, a directory outside any work tree (an installed wheel), and a directory inside
    some other project's tree that does not track it (site-packages of a virtual environment kept there).
    """
    toplevel = _git(directory, "rev-parse", "--show-toplevel")
    if toplevel is None or not directory.resolve().is_relative_to(Path(toplevel).resolve()):
        return UNKNOWN, UNKNOWN
    if _git(directory, "ls-files", "--error-unmatch", "--", ".") is None:
        return UNKNOWN, UNKNOWN
    commit = _git(directory, "rev-parse", "HEAD")
    if commit is None:
        return UNKNOWN, UNKNOWN
    # Dirty means the code that runs differs from the commit: the package (untracked files in it
    # included) or pyproject.toml. Result CSVs and notes written into the tree do not count.
    status = _git(Path(toplevel), "status", "--porcelain", "--", str(directory.resolve()), "pyproject.toml")
    return commit, UNKNOWN if status is None else str(bool(status)).lower()


@functools.cache
def source_git_state() -> tuple[str, str]:
    """git_state of the sbpbench source, looked up once per process (every result row asks for it)."""
    return git_state(PACKAGE_DIR)


def _git(directory: Path, *args: str) -> str | None:
    """Stripped stdout of `git -C directory args`, or None when git is missing, fails or hangs."""
    # --no-optional-locks: `git status` must not take the index lock from someone working in the checkout.
    command = ["git", "--no-optional-locks", "-C", str(directory), *args]
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
