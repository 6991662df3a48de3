"""Each measured point in a fresh process, so a peak, a fragmented cache or an OOM never leaks
into the next point. The parent never touches CUDA (provenance comes from NVML), so it takes no
GPU memory from the point it measures.

Outcome classes: ok | oom (CUDA OOM, host allocation failure, or the tracked peak over
--memory-limit on the CPU) | error (anything else, with the worker's one-line reason) | timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields
from datetime import datetime, timezone
from pathlib import Path

from ..config import RunSpec
from ..config.rows import spec_fields
from ..measure.environment import Environment, capture_environment
from ..methods import METHODS
from ..records import ResultRow, upsert_rows

_ROW_FIELDS = {f.name for f in fields(ResultRow)}
_STDERR_TAIL_LINES = 20


def provenance(env: Environment) -> dict:
    """The row columns an environment fills (all but `device`, which the spec sets)."""
    values = env.as_dict()
    return {k: v for k, v in values.items() if k in _ROW_FIELDS and k != "device"}


def _last_error_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


def run_isolated(spec: RunSpec, env: Environment | None = None) -> ResultRow:
    """Measure one point in a worker process and return its row, provenance filled."""
    env = env or capture_environment(spec.device)
    if METHODS[spec.method].external:  # its own environment and driver, the same protocol
        from .official import run_official

        row = run_official(spec, env)
        row.timestamp_utc = datetime.now(timezone.utc).isoformat(timespec="seconds")
        return row
    with tempfile.TemporaryDirectory(prefix="sbp-point-") as tmp:
        result_path = Path(tmp) / "result.json"
        worker = subprocess.Popen(
            [sys.executable, "-m", "sbpbench.runner.worker", str(result_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: a timeout kills all of it
        )
        try:
            _, stderr = worker.communicate(spec.to_json(), timeout=spec.timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            _, stderr = worker.communicate()
            timed_out = True
        except BaseException:  # Ctrl-C or a kill of this process: the worker must not outlive it
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
            raise
        if result_path.exists():
            row = ResultRow(**json.loads(result_path.read_text()))
        else:
            row = ResultRow(**spec_fields(spec))
            if timed_out:
                row.status, row.error = "timeout", f"no result after {spec.timeout_s:g} s (--timeout)"
            elif worker.returncode == -signal.SIGKILL:
                row.status, row.error = "error", "worker killed by SIGKILL (out of host memory?)"
            else:
                reason = _last_error_line(stderr) or "no output"
                row.status, row.error = "error", f"worker exited with code {worker.returncode}: {reason}"
    if row.status == "error" and os.environ.get("SBP_DEBUG"):
        print("\n".join(stderr.splitlines()[-_STDERR_TAIL_LINES:]), file=sys.stderr)
    for name, value in provenance(env).items():
        setattr(row, name, value)
    row.timestamp_utc = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return row


def run_points(
    specs: Iterable[RunSpec],
    out: str | Path | None,
    *,
    measure: Callable[[RunSpec, Environment], ResultRow] = run_isolated,
) -> Iterator[ResultRow]:
    """Measure points one by one; each row is in the CSV (upserted by key) before it is yielded,
    so an interrupted run keeps every finished point."""
    envs: dict[str, Environment] = {}
    for spec in specs:
        if spec.device not in envs:
            envs[spec.device] = capture_environment(spec.device)
        env = envs[spec.device]
        row = measure(spec, env)
        if out is not None:
            upsert_rows(out, [row])
        yield row
