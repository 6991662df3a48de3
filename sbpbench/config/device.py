"""Device names: resolved once, when a run config is built, to what torch.cuda calls need.

torch.cuda.set_device and friends reject an index-less "cuda" (seen on an H100: every `sbp run`
point failed with "Expected a torch.device with a specified index"), so a config never holds one:
"auto" and "cuda" become "cuda:<current device>", and rows record the indexed name.
"""

from __future__ import annotations

import re

import torch

from ..settings import ConfigError

_CUDA = re.compile(r"^cuda(?::(\d+))?$")


def resolve_device(device: str, field: str = "device") -> str:
    """ "auto" -> "cuda:N" (the current CUDA device) if a GPU is visible, else "cpu";
    "cuda" -> "cuda:N"; "cuda:N" checked against the visible count; "cpu" as is."""
    device = str(device).strip().lower()
    if device == "cpu":
        return device
    if device == "auto":
        if not torch.cuda.is_available():
            return "cpu"
        device = "cuda"
    match = _CUDA.match(device)
    if match is None:
        raise ConfigError(field, f"unknown {{field}} {device!r}; use auto, cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(match.group(1) or 0)
    check_visible(device, index, count, field)
    return f"cuda:{index}"


def check_visible(device: str, index: int, count: int, field: str = "device") -> None:
    """Refuse `device`, cuda:index, where `count` CUDA GPUs are visible (0: none), in one line that
    says what exists. The count is torch's here, NVML's where a process must not initialise CUDA."""
    if count == 0:
        raise ConfigError(field, f"{device!r} was asked for but no CUDA GPU is visible; use cpu")
    if not 0 <= index < count:
        raise ConfigError(
            field, f"cuda:{index} does not exist: {count} CUDA device(s) visible (cuda:0..cuda:{count - 1})"
        )


def device_kind(device: str) -> str:
    """ "cuda" or "cpu": which defaults a resolved device gets."""
    return "cuda" if device.startswith("cuda") else "cpu"
