"""Process peak resident set size over a region.

Linux keeps the high-water mark in /proc/self/status (VmHWM) and resets it when "5" is written to
/proc/self/clear_refs (since Linux 4.0), so the peak can be taken per step, not per process. Where
that is not possible the lifetime peak from getrusage is reported instead (an upper bound).
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _vm_hwm_bytes() -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Start a new peak; False where the kernel does not allow it."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    hwm = _vm_hwm_bytes()
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB on Linux


def total_ram_bytes() -> int:
    """Physical memory of this machine (the default host limit of a simulated placement)."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_ram_bytes() -> int:
    """Memory a new allocation can get now without swapping (Linux: MemAvailable of /proc/meminfo);
    the machine's RAM where that is unreadable."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, IndexError, ValueError):
        pass
    return total_ram_bytes()


_STATM = Path("/proc/self/statm")
_PAGE_BYTES = resource.getpagesize()


def rss_bytes() -> int | None:
    """The process's resident set now (Linux: /proc/self/statm, one read); None where unreadable."""
    try:
        return int(_STATM.read_text().split()[1]) * _PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return None
