"""The host copy rate each way, between page-locked host memory and the device, as StreamBP's offload
and stream placements copy (core/placements/host_copies.py): the number the planner assumes
(simulate/timing.py `host_copy_bytes_s`), measured.

    python -m sbpbench.measure.copy_rate --out copy-rate.csv

One buffer of DEFAULT_BYTES is copied each way: one warm-up copy discarded, then `--repeats` copies,
each timed with the device synchronised around it (measure/timing.py); the median and the spread are
kept. GB/s is 10^9 bytes per second, as bus rates are quoted. On a CPU the same code copies between
two ordinary buffers: a check of the code, not of a bus.
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path

import torch

from .environment import capture_environment
from .timing import time_steps

DEFAULT_BYTES = 65536 * 4096 * 2  # a Qwen3-8B layer input at T = 65,536 in bf16: 512 MiB
HOST_TO_DEVICE, DEVICE_TO_HOST = "host to device", "device to host"


@dataclass
class CopyRate:
    """One direction's copies: the CSV's columns, in order."""

    direction: str  # HOST_TO_DEVICE | DEVICE_TO_HOST
    num_bytes: int
    pinned: bool  # the host buffer page-locked (always on CUDA)
    repeats: int
    seconds_p50: float
    seconds_min: float
    seconds_max: float
    gb_per_s: float  # num_bytes / seconds_p50 / 1e9
    device: str = ""
    device_name: str = ""
    torch_version: str = ""
    cuda_version: str = ""
    git_commit: str = ""
    git_dirty: str = ""
    timestamp_utc: str = ""


def measure_copy_rates(device: torch.device, num_bytes: int = DEFAULT_BYTES, repeats: int = 5) -> list[CopyRate]:
    """Host to device, then device to host, of one num_bytes buffer each way."""
    cuda = device.type == "cuda"
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=cuda)  # (num_bytes,), page-locked on CUDA
    host.fill_(1)  # fault the pages in before any copy is timed
    on_device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    synchronize = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    copies = {
        HOST_TO_DEVICE: lambda: on_device.copy_(host, non_blocking=cuda),
        DEVICE_TO_HOST: lambda: host.copy_(on_device, non_blocking=cuda),
    }
    env = capture_environment(str(device))
    rates = []
    for direction, copy in copies.items():
        copy()  # warm-up, discarded
        synchronize()
        stats = time_steps(copy, repeats=repeats, synchronize=synchronize)
        rates.append(
            CopyRate(
                direction, num_bytes, cuda, repeats, stats.median_s, stats.min_s, stats.max_s,
                num_bytes / stats.median_s / 1e9, device=str(device), device_name=env.device_name,
                torch_version=env.torch_version, cuda_version=env.cuda_version, git_commit=env.git_commit,
                git_dirty=env.git_dirty, timestamp_utc=datetime.now(UTC).isoformat(timespec="seconds"),
            )
        )  # fmt: skip
    return rates


def write_csv(rates: list[CopyRate], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[field.name for field in fields(CopyRate)])
        writer.writeheader()
        writer.writerows(asdict(rate) for rate in rates)


def read_csv(path: Path) -> list[dict]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="CSV to write (replaced)")
    parser.add_argument("--bytes", type=int, default=DEFAULT_BYTES, help=f"bytes per copy (default: {DEFAULT_BYTES})")
    parser.add_argument("--repeats", type=int, default=5, help="timed copies each way (default: 5)")
    parser.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    args = parser.parse_args(argv)
    if args.bytes < 1 or args.repeats < 1:
        parser.error("--bytes and --repeats must be at least 1")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rates = measure_copy_rates(device, args.bytes, args.repeats)
    write_csv(rates, args.out)
    for rate in rates:
        print(
            f"{rate.direction}: {rate.gb_per_s:.1f} GB/s ({rate.num_bytes / 2**20:.0f} MiB, median of {rate.repeats})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
