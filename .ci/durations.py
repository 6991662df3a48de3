"""Fail on a fast-tier test that broke the 3 s rule (docs/architecture.md): a test over about 3 s on
2 cores is marked slow.

Reads the fast tier's log, run with `--durations=0 --durations-min=1`, and its lines such as
`4.21s call     tests/test_x.py::test_y`. Only the call phase counts (a module fixture's setup is
shared by its tests). The limit is LIMIT_S x ALLOWANCE: in .ci/run the fast tier shares the 2 cores
with the slow tier's two workers, three busy processes on two cores, so a test takes about 1.5x its
time alone; ALLOWANCE = 2 leaves a margin over that for the machine's own load.

    python .ci/durations.py FAST_LOG
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

LIMIT_S = 3.0  # the rule, for a test alone on 2 cores
ALLOWANCE = 2.0  # beside the slow tier (about 1.5x) plus a margin for the machine's load
LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s call\s+(\S+)")


def over_limit(log: str, limit_s: float = LIMIT_S * ALLOWANCE) -> list[tuple[float, str]]:
    """(seconds, test id) of each call over limit_s, slowest first."""
    found = [(float(m.group(1)), m.group(2)) for m in map(LINE.match, log.splitlines()) if m]
    return sorted((entry for entry in found if entry[0] > limit_s), reverse=True)


def main(argv: list[str]) -> int:
    slow = over_limit(Path(argv[0]).read_text())
    for seconds, test in slow:
        print(f"{test}: {seconds:.1f} s, over {LIMIT_S * ALLOWANCE:g} s: mark it slow or make it faster")
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
