"""The worker process of one point: `python -m sbpbench.runner.worker RESULT.json < SPEC.json`, or
`run_point` in a worker forked by the fork server (fork_server.py).

Reads a RunSpec as JSON on stdin (`request_json`: with a "timeline_dir" member when the memory step's
timeline is to be recorded there, a "trace_dir" member when a step is to be traced there,
runner/traces.py), measures it, and writes one JSON object (a ResultRow without provenance) to
RESULT.json, atomically, so the parent never reads half a result. Model code may print to
stdout/stderr freely: the result does not travel through them.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_PID_ENV = "SBP_PARENT_PID"  # the pid of the process that started this worker (runner/isolated.py)
TIMELINE_DIR = "timeline_dir"
TRACE_DIR = "trace_dir"


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this worker when its parent dies, even by SIGKILL (which the
    parent cannot catch to kill its worker itself). If the parent died first, exit now: the parent
    named in PARENT_PID_ENV is not this process's parent any more (an orphan is adopted by init or
    by a subreaper, so its new parent's pid says little). Elsewhere a no-op."""
    expected = os.environ.pop(PARENT_PID_ENV, None)  # not passed on to this worker's own children
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    parent = os.getppid()
    if parent == 1 or (expected is not None and parent != int(expected)):  # gone before the request took effect
        os._exit(1)


if __name__ == "__main__":
    die_with_parent()  # before the imports below: seconds in which a parent's death would go unseen

from ..config import RunSpec  # noqa: E402
from . import ranks  # noqa: E402
from .point import measure_point  # noqa: E402
from .traces import tracing_into  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m sbpbench.runner.worker RESULT.json < SPEC.json", file=sys.stderr)
        return 2
    return run_point(sys.stdin.read(), Path(argv[0]))


def request_json(spec: RunSpec, timeline_dir: Path | None = None, trace_dir: Path | None = None) -> str:
    """What a worker reads: the spec's JSON, and where to record the timeline and the trace if wanted."""
    folders = {TIMELINE_DIR: timeline_dir, TRACE_DIR: trace_dir}
    given = {name: str(Path(folder).resolve()) for name, folder in folders.items() if folder is not None}
    if not given:
        return spec.to_json()
    return json.dumps({**json.loads(spec.to_json()), **given})


def run_point(spec_json: str, result_path: Path) -> int:
    """Measure the point and write its result; in a fresh worker (main) or a forked one (fork_server.py)."""
    die_with_parent()  # a fresh worker's again (a no-op); a forked one's parent is the fork server
    values = json.loads(spec_json)
    timeline_dir, trace_dir = values.pop(TIMELINE_DIR, None), values.pop(TRACE_DIR, None)
    spec = RunSpec.from_json(json.dumps(values))
    with tracing_into(trace_dir):
        row = measure_point(spec, timeline_dir)
    tmp = result_path.with_name(result_path.name + ".tmp")
    tmp.write_text(json.dumps(row.as_dict()))
    os.replace(tmp, result_path)
    if spec.nproc > 1:  # one rank of several (runner/ranks.py)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            # a rank whose step failed may leave its peers waiting in a collective: nccl's
            # destroy_process_group could wait with them, and this process exits now anyway
            if row.status == "ok":
                ranks.leave()
        finally:
            os._exit(0)  # gloo can abort at interpreter exit ("terminate called without an active exception")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
