"""CPU threads of a measurement: how many intra-op threads a point runs with, and how busy the
machine was. A CPU step's time depends on both far more than on anything else in the row:
oversubscribed threads (more runnable threads than cores) slowed StreamBP's many chunk-sized
operations 9x on a loaded 2-core machine, bp and ckpt 2-3x.
"""

from __future__ import annotations

import os
from pathlib import Path


def available_cpus() -> set[int]:
    """The logical CPUs this process may run on (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def physical_cores_available() -> int:
    """Physical cores among the CPUs this process may run on: hyperthread siblings count once
    (they share one core's arithmetic units, so a second thread per core adds contention, not
    speed, to dense kernels). Without a readable topology every logical CPU counts."""
    cores = set()
    for cpu in available_cpus():
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            package, core = "cpu", str(cpu)
        cores.add((package, core))
    return max(1, len(cores))


def default_threads() -> int:
    """A point's thread count when none is given: OMP_NUM_THREADS when it is set to a positive
    integer (as torch itself honours it), else the physical cores this process may use."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) >= 1:
        return int(value)
    return physical_cores_available()


def set_intra_op_threads(num_threads: int) -> int:
    """Set torch's intra-op thread count (OpenMP / MKL) for this process; returns what torch took."""
    import torch

    torch.set_num_threads(num_threads)
    return torch.get_num_threads()


def load_average_1m() -> float | None:
    """The system's 1-minute load average (runnable + uninterruptible tasks), None where unknown."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def busy_warning() -> str | None:
    """A one-line warning when the machine's load exceeds its CPUs (the load is system-wide, so it
    is compared with every CPU of the system), else None."""
    load, num_cpus = load_average_1m(), os.cpu_count() or 1
    if load is None or load <= num_cpus:
        return None
    return (
        f"warning: load average {load:.1f} on {num_cpus} CPU(s): other work competes for the cores, so CPU times "
        "will be slower and noisier than on an idle machine (each row records load_avg_1m and num_threads)"
    )
