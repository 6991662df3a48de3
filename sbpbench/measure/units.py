"""Byte sizes and durations: parse what users type ("80GiB", "80GB", "512MiB", "1e9B"; "9m", "540s") and show GiB (2^30).

A size a user types carries its unit: a bare "80" is refused, not read as 80 bytes (a GPU of 80
bytes fits nothing, and said so for every method). Python callers give byte counts as ints."""

from __future__ import annotations

import math
import re

GIB = 2**30

_UNITS = {
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str, what: str = "the size") -> int:
    """'80GiB' -> 85899345920; 'GB' is 10^9, 'GiB' 2^30, 'B' bytes. A number without a unit is a
    ValueError that says to add one; `what` names the value in it (a flag, "{field}")."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match and not unit:
        number = match.group(1)
        if "e" in number.lower():  # a byte count in scientific notation, 1e9
            raise ValueError(f"{what} {text!r} has no unit: write {number}B for bytes, or a size such as 80GiB")
        raise ValueError(f"{what} {text!r} has no unit: write {number}GiB (2^30 bytes) or {number}GB (10^9 bytes)")
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read {what} {text!r}; write e.g. 80GiB, 24GB, 512MiB or 1e9B")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {text!r}; write e.g. 80GiB")
    return value


def gib(nbytes: float | None, digits: int = 2) -> str:
    """GiB with `digits` decimals; a size above 0 that would round to 0 keeps two significant digits
    (a tiny model's 0.0034, never 0.00)."""
    if nbytes is None:
        return "-"
    value = nbytes / GIB
    if 0 < value < 0.5 * 10**-digits:
        digits = 1 - math.floor(math.log10(value))
    return f"{value:.{digits}f}"


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|m|min|h)?\s*$", re.IGNORECASE)
_SECONDS = {None: 1, "s": 1, "m": 60, "min": 60, "h": 3600}


def parse_seconds(text: str) -> float:
    """'9m' -> 540.0; 's', 'm' (or 'min') and 'h'; a bare number is seconds."""
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"cannot read the duration {text!r}; write e.g. 9m, 540s, 1.5h or a number of seconds")
    if float(match.group(1)) <= 0:
        raise ValueError(f"the duration {text!r} is not above zero; write e.g. 9m, 540s or 1.5h")
    unit = match.group(2).lower() if match.group(2) else None
    return float(match.group(1)) * _SECONDS[unit]


def duration(seconds: float) -> str:
    """12 s, 3 min 05 s, 1 h 02 min."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
