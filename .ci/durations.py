"""Fail on a fast-tier test that broke the 3 s rule (docs/architecture.md): a test over about 3 s on
2 cores is marked slow.

Reads the fast tier's log, run with `--durations=0 --durations-min=1`, and its lines such as
`4.21s call     tests/test_x.py::test_y`. Only the call phase counts (a module fixture's setup is
shared by its tests). The limit is LIMIT_S x the allowance: in .ci/run the fast tier shares the 2
cores with the slow tier's two workers, three busy processes on two cores, so a test takes about
1.5x its time alone. The allowance is 2, or 1.5 x the load per core where the machine was busier
than that (other work on it slows every test alike). The load is the highest 1-minute load in
LOAD_LOG, lines of /proc/loadavg that .ci/run samples while the fast tier runs; without one, the
load now.

    python .ci/durations.py FAST_LOG [LOAD_LOG]
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

LIMIT_S = 3.0  # the rule, for a test alone on 2 cores
MIN_ALLOWANCE = 2.0  # beside the slow tier (about 1.5x) plus a margin
LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s call\s+(\S+)")


def allowance(load_1m: float, cpus: int) -> float:
    """How much slower than alone a test may run: MIN_ALLOWANCE, or 1.5 x the load per core."""
    return max(MIN_ALLOWANCE, 1.5 * load_1m / max(1, cpus))


def over_limit(log: str, limit_s: float) -> list[tuple[float, str]]:
    """(seconds, test id) of each call over limit_s, slowest first."""
    found = [(float(m.group(1)), m.group(2)) for m in map(LINE.match, log.splitlines()) if m]
    return sorted((entry for entry in found if entry[0] > limit_s), reverse=True)


def peak_load(samples: str) -> float | None:
    """The highest 1-minute load among lines of /proc/loadavg ("3.12 2.80 2.10 3/412 9021"), or None."""
    loads = [float(line.split()[0]) for line in samples.splitlines() if line.strip()]
    return max(loads, default=None)


def main(argv: list[str]) -> int:
    sampled = peak_load(Path(argv[1]).read_text()) if len(argv) > 1 and Path(argv[1]).exists() else None
    load = sampled if sampled is not None else os.getloadavg()[0]
    limit_s = LIMIT_S * allowance(load, os.cpu_count() or 1)
    slow = over_limit(Path(argv[0]).read_text(), limit_s)
    for seconds, test in slow:
        print(f"{test}: {seconds:.1f} s, over {limit_s:.1f} s (3 s alone): mark it slow or make it faster")
    print(f"3 s rule: {len(slow)} fast-tier test(s) over {limit_s:.1f} s (peak 1-minute load {load:.1f})")
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
