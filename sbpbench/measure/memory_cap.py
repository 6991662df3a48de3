"""The memory cap a point runs under, given the cap it asked for and what the device has."""

from __future__ import annotations


def memory_cap(requested: int | None, capacity: int) -> int | None:
    """The limit asked for, or the capacity where the limit is above it (the paper's 80 GiB is
    85.9e9 B, above an H100's 79.6 GiB; on the CPU the cap applies to tracked bytes against the
    machine's RAM). None: no cap."""
    return None if requested is None else min(requested, capacity)
