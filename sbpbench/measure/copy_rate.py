"""The host copy rate each way, between page-locked host memory and the device, as StreamBP's offload
and stream placements copy (core/placements/host_copies.py): the number the planner assumes
(simulate/timing.py `host_copy_bytes_s`), measured.

    python -m sbpbench.measure.copy_rate --out copy-rate.csv

One buffer of DEFAULT_BYTES is copied each way: one warm-up copy discarded, then `--repeats` copies,
each timed with the device synchronised around it (measure/timing.py); the median and the spread are
kept. GB/s is 10^9 bytes per second, as bus rates are quoted. On CUDA the host buffer is of two
kinds, a row each way for each:
    pin_memory        torch's pinned allocator (cudaHostAlloc)
    cudaHostRegister  pageable memory page-locked in place, whole pages from a page boundary: what the
                      stores' pool holds (core/host_pool.py), whose rate the placements get
On a CPU the same code copies between two ordinary buffers ("pageable"): a check of the code, not of a bus.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path

import torch

from .environment import capture_environment
from .timing import time_steps

DEFAULT_BYTES = 65536 * 4096 * 2  # a Qwen3-8B layer input at T = 65,536 in bf16: 512 MiB
HOST_TO_DEVICE, DEVICE_TO_HOST = "host to device", "device to host"
PIN_MEMORY, HOST_REGISTER, PAGEABLE = "pin_memory", "cudaHostRegister", "pageable"  # the host buffer's kind
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
Register = Callable[[int, int], int]  # (address, bytes) -> cudaError_t, 0 for success
Unregister = Callable[[int], int]  # (address) -> cudaError_t


def _cuda_register(address: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))


def _cuda_unregister(address: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(address))


@contextmanager
def registered_buffer(
    num_bytes: int, register: Register = _cuda_register, unregister: Unregister = _cuda_unregister
) -> Iterator[torch.Tensor]:
    """num_bytes of ordinary host memory page-locked in place, as the stores' pool does it: a page
    more allocated, the range started on a page boundary and rounded to whole pages, every page
    touched first, one registration; unregistered on exit, before the memory is freed."""
    need = -(-num_bytes // PAGE_BYTES) * PAGE_BYTES
    raw = torch.empty(need + PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % PAGE_BYTES
    pages = raw[offset : offset + need]
    pages[::PAGE_BYTES].fill_(0)  # fault the pages in on torch's threads, not one by one in the driver
    error = register(pages.data_ptr(), need)
    if error:
        raise RuntimeError(f"cudaHostRegister of {need:,} B failed: cudaError {error}")
    try:
        yield pages[:num_bytes]
    finally:
        unregister(pages.data_ptr())


CUDA_PAGE_LOCK = (_cuda_register, _cuda_unregister)


@contextmanager
def host_buffer(
    kind: str, num_bytes: int, page_lock: tuple[Register, Unregister] = CUDA_PAGE_LOCK
) -> Iterator[torch.Tensor]:
    """A (num_bytes,) uint8 host buffer of `kind`, its pages faulted in."""
    if kind == HOST_REGISTER:
        with registered_buffer(num_bytes, *page_lock) as pages:
            pages.fill_(1)
            yield pages
        return
    buffer = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=kind == PIN_MEMORY)
    buffer.fill_(1)  # fault the pages in before any copy is timed
    yield buffer


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
    host_buffer: str = ""  # PIN_MEMORY | HOST_REGISTER (CUDA), PAGEABLE (a CPU)
    device: str = ""
    device_name: str = ""
    torch_version: str = ""
    cuda_version: str = ""
    git_commit: str = ""
    git_dirty: str = ""
    timestamp_utc: str = ""


def measure_copy_rates(
    device: torch.device,
    num_bytes: int = DEFAULT_BYTES,
    repeats: int = 5,
    kinds: tuple[str, ...] | None = None,
    page_lock: tuple[Register, Unregister] = CUDA_PAGE_LOCK,
) -> list[CopyRate]:
    """Host to device, then device to host, of one num_bytes buffer each way, for each kind of host
    buffer (default: both page-locked kinds on CUDA, pageable on a CPU). page_lock: cudaHostRegister
    and cudaHostUnregister as the registered kind calls them (tests: stand-ins)."""
    cuda = device.type == "cuda"
    kinds = kinds or ((PIN_MEMORY, HOST_REGISTER) if cuda else (PAGEABLE,))
    on_device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    synchronize = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    env = capture_environment(str(device))
    rates = []
    for kind in kinds:
        with host_buffer(kind, num_bytes, page_lock) as host:  # (num_bytes,)
            copies = {
                HOST_TO_DEVICE: lambda host=host: on_device.copy_(host, non_blocking=cuda),
                DEVICE_TO_HOST: lambda host=host: host.copy_(on_device, non_blocking=cuda),
            }
            for direction, copy in copies.items():
                copy()  # warm-up, discarded
                synchronize()
                stats = time_steps(copy, repeats=repeats, synchronize=synchronize)
                rates.append(
                    CopyRate(
                        direction, num_bytes, kind != PAGEABLE, repeats, stats.median_s, stats.min_s, stats.max_s,
                        num_bytes / stats.median_s / 1e9, host_buffer=kind, device=str(device),
                        device_name=env.device_name, torch_version=env.torch_version, cuda_version=env.cuda_version,
                        git_commit=env.git_commit, git_dirty=env.git_dirty,
                        timestamp_utc=datetime.now(UTC).isoformat(timespec="seconds"),
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
            f"{rate.direction}, {rate.host_buffer}: {rate.gb_per_s:.1f} GB/s "
            f"({rate.num_bytes / 2**20:.0f} MiB, median of {rate.repeats})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
