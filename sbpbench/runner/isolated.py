"""Each measured point in a fresh process, so a peak, a fragmented cache or an OOM never leaks
into the next point. The parent never touches CUDA (provenance comes from NVML), so it takes no
GPU memory from the point it measures.

Outcome classes: ok | oom (CUDA OOM, host allocation failure, or the tracked peak over
--memory-limit on the CPU) | error (anything else, with the worker's one-line reason) | timeout.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from datetime import datetime, timezone
from pathlib import Path

from ..config import RunSpec
from ..config.rows import spec_fields
from ..measure.environment import Environment, capture_environment
from ..measure.progress import PROGRESS_PREFIX
from ..methods import METHODS
from ..records import ResultRow, upsert_rows

_ROW_FIELDS = {f.name for f in fields(ResultRow)}
_STDERR_TAIL_LINES = 20
POINT_DIR_PREFIX = "sbp-point-"
_HELD = ".held"  # flocked by the process that owns a point's directory, for as long as it runs
_HELD_GRACE_S = 60  # an unheld directory younger than this may be one whose owner has not locked it yet
_UNMARKED_STALE_S = 3600  # a directory without the mark (an older sbpbench's) is stale after an hour


def provenance(env: Environment) -> dict:
    """The row columns an environment fills (all but `device`, which the spec sets)."""
    values = env.as_dict()
    return {k: v for k, v in values.items() if k in _ROW_FIELDS and k != "device"}


def _last_error_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


@contextmanager
def point_directory() -> Iterator[Path]:
    """A temporary directory for one point's result, held (flock on a file inside) while in use
    and removed after; one a killed process left behind is removed by remove_stale_point_dirs."""
    tmp = Path(tempfile.mkdtemp(prefix=POINT_DIR_PREFIX))
    held = (tmp / _HELD).open("w")
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield tmp
    finally:
        held.close()
        shutil.rmtree(tmp, ignore_errors=True)


@functools.cache  # once per process
def remove_stale_point_dirs(root: str | None = None) -> int:
    """Remove point directories under the temporary root that no running process holds (left by
    a SIGKILLed run); returns how many."""
    removed = 0
    for directory in Path(root or tempfile.gettempdir()).glob(POINT_DIR_PREFIX + "*"):
        try:
            age_s = time.time() - directory.stat().st_mtime
            with (directory / _HELD).open("r") as held:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its owner runs
            stale = age_s > _HELD_GRACE_S  # not one whose owner is between creating and locking it
        except FileNotFoundError:  # unmarked (or gone): stale once old
            stale = directory.exists() and age_s > _UNMARKED_STALE_S
        except OSError:  # held, or not ours to read
            stale = False
        if stale:
            shutil.rmtree(directory, ignore_errors=True)
            removed += 1
    return removed


def _read_stderr(pipe, lines: list[str]) -> None:
    """Keep the worker's stderr for its error line, and pass its progress lines (a long step's
    "layer i of L", measure/progress.py) on to this process's stderr as they come."""
    for line in pipe:
        lines.append(line)
        if line.startswith(PROGRESS_PREFIX):
            sys.stderr.write(line)
            sys.stderr.flush()


def run_isolated(spec: RunSpec, env: Environment | None = None) -> ResultRow:
    """Measure one point in a worker process and return its row, provenance filled."""
    env = env or capture_environment(spec.device)
    if METHODS[spec.method].external:  # its own environment and driver, the same protocol
        from .official import run_official

        row = run_official(spec, env)
        row.timestamp_utc = datetime.now(timezone.utc).isoformat(timespec="seconds")
        return row
    remove_stale_point_dirs()
    with point_directory() as tmp:
        result_path = tmp / "result.json"
        worker = subprocess.Popen(
            [sys.executable, "-m", "sbpbench.runner.worker", str(result_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: a timeout kills all of it
        )
        lines: list[str] = []
        reader = threading.Thread(target=_read_stderr, args=(worker.stderr, lines), daemon=True)
        reader.start()
        try:
            try:
                worker.stdin.write(spec.to_json())
                worker.stdin.close()
            except BrokenPipeError:  # the worker died at start; its stderr says why
                pass
            worker.wait(timeout=spec.timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
            timed_out = True
        except BaseException:  # Ctrl-C or a kill of this process: the worker must not outlive it
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
            raise
        reader.join()
        stderr = "".join(lines)
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
