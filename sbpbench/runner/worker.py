"""The worker process of one point: `python -m sbpbench.runner.worker RESULT.json < SPEC.json`.

Reads a RunSpec as JSON on stdin, measures it, and writes one JSON object (a ResultRow without
provenance) to RESULT.json, atomically, so the parent never reads half a result. Model code may
print to stdout/stderr freely: the result does not travel through them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .point import measure_point
from .spec import RunSpec


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m sbpbench.runner.worker RESULT.json < SPEC.json", file=sys.stderr)
        return 2
    result_path = Path(argv[0])
    row = measure_point(RunSpec.from_json(sys.stdin.read()))
    tmp = result_path.with_name(result_path.name + ".tmp")
    tmp.write_text(json.dumps(row.as_dict()))
    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
