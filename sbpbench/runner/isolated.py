"""Each measured point in a process of its own, so a peak, a fragmented cache or an OOM never leaks
into the next point: a fresh interpreter on a GPU, a fork of the fork server on the CPU
(fork_server.py: the same start state without the imports). The parent never touches CUDA
(provenance comes from NVML), so it takes no GPU memory from the point it measures.

Outcome classes: ok | oom (CUDA OOM, host allocation failure, or the tracked peak over
--memory-limit on the CPU) | error (anything else, with the worker's one-line reason) | timeout.
A worker dies with this process however it ends: a SIGTERM unwinds into killing the workers' group,
and the kernel kills a worker whose parent is gone (worker.py, before the worker's imports).
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
from datetime import UTC, datetime
from pathlib import Path

from ..config import RunSpec
from ..measure.environment import Environment, capture_environment
from ..measure.progress import PROGRESS_PREFIX
from ..methods import METHODS, data_parallel_unsupported
from ..records import ResultRow, upsert_rows
from ..workload.rows import provenance, spec_fields
from . import fork_server
from .allocator import worker_environment
from .official import run_official
from .ranks import INIT_METHOD_ENV, merge_rank_rows
from .timelines import finish as finish_timeline
from .timelines import timeline_dir as timelines_beside
from .timeout import point_timeout_s
from .traces import finish as finish_trace
from .traces import trace_dir as traces_beside
from .worker import PARENT_PID_ENV, request_json

_STDERR_TAIL_LINES = 20
POINT_DIR_PREFIX = "sbp-point-"
# Raw fcntl, not the `filelock` package: its FileLock creates the file it probes (O_CREAT), which would
# turn an unmarked directory (an older sbpbench's, stale after an hour) into a marked, unheld one.
_HELD = ".held"  # flocked by the process that owns a point's directory, for as long as it runs
_HELD_GRACE_S = 60  # an unheld directory younger than this may be one whose owner has not locked it yet
_UNMARKED_STALE_S = 3600  # a directory without the mark (an older sbpbench's) is stale after an hour
Worker = subprocess.Popen | fork_server.ForkedWorker  # what _start_worker returns
# After one rank exits without an ok result, how long the others may take to finish on their own
# (a rank blocked in a collective with the failed one never would): then they are killed.
RANK_GRACE_S = 30.0


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


def run_isolated(
    spec: RunSpec, env: Environment | None = None, *, timeline_dir: Path | None = None, trace_dir: Path | None = None
) -> ResultRow:
    """Measure one point in a worker process and return its row, provenance filled. timeline_dir: the
    worker records its memory step's timeline there (runner/timelines.py; one process's point only);
    trace_dir: it profiles one step after the timed ones there (runner/traces.py; the same)."""
    env = env or capture_environment(spec.device)
    reason = data_parallel_unsupported(spec.method, spec.nproc)
    if METHODS[spec.method].external and reason is None:  # its own environment and driver, the same protocol
        row = run_official(spec, env)
        row.timestamp_utc = datetime.now(UTC).isoformat(timespec="seconds")
        return row
    remove_stale_point_dirs()
    stderr = ""
    if reason is not None:  # not launched: the method has no sharded path
        row = ResultRow(**spec_fields(spec))
        row.status, row.error = "unsupported", reason
    else:
        with point_directory() as tmp:
            row, stderr = _run_workers(spec, tmp, timeline_dir, trace_dir)
    if row.status == "error" and os.environ.get("SBP_DEBUG"):
        print("\n".join(stderr.splitlines()[-_STDERR_TAIL_LINES:]), file=sys.stderr)
    for name, value in provenance(env).items():
        setattr(row, name, value)
    row.timestamp_utc = datetime.now(UTC).isoformat(timespec="seconds")
    notice = cap_notice(row)
    if notice:
        _say_once(notice)
    return row


def cap_notice(row: ResultRow) -> str | None:
    """One line when the point ran under a smaller cap than it asked for (measure/memory_cap.py):
    the device had less."""
    asked, used = row.memory_limit_bytes, row.memory_limit_effective_bytes
    if asked is None or used is None or used >= asked:
        return None
    where = (
        f"the total memory of {row.device_name or row.device}"
        if row.device.startswith("cuda")
        else "this machine's RAM"
    )
    return (
        f"notice: --memory-limit {asked / 2**30:.2f} GiB ({asked:,} B) is above {where}: the point ran capped at "
        f"{used / 2**30:.2f} GiB ({used:,} B), recorded as memory_limit_effective_bytes"
    )


@functools.cache  # once per command for each distinct line (a search's probes share theirs)
def _say_once(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _start_worker(
    spec: RunSpec,
    result_path: Path,
    env: dict | None,
    group: int | None,
    timeline_dir: Path | None = None,
    trace_dir: Path | None = None,
) -> Worker:
    """One worker. A point's only worker gets a session of its own; several ranks share a process
    group (the first rank's: group 0 makes it), so a timeout or Ctrl-C kills all of them at once.
    CPU workers are forked from the fork server when it runs (fork_server.py: no import per point)."""
    if spec.device == "cpu" and fork_server.enabled():
        try:
            return fork_server.shared_server().start(
                request_json(spec, timeline_dir, trace_dir),
                result_path,
                env or dict(os.environ),
                None if spec.nproc == 1 else (group or 0),
            )
        except fork_server.ForkServerUnavailable as error:
            if os.environ.get("SBP_DEBUG"):
                print(f"fork server: {error}; starting a fresh worker", file=sys.stderr)
    worker = subprocess.Popen(
        [sys.executable, "-m", "sbpbench.runner.worker", str(result_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**(env or os.environ), PARENT_PID_ENV: str(os.getpid())},  # it dies with this process (worker.py)
        start_new_session=spec.nproc == 1,
        process_group=None if spec.nproc == 1 else (group or 0),
    )
    try:
        worker.stdin.write(request_json(spec, timeline_dir, trace_dir))
        worker.stdin.close()
    except BrokenPipeError:  # the worker died at start; its stderr says why
        pass
    return worker


def _wait(workers: list[Worker], results: list[Path], timeout_s: float) -> bool:
    """Wait for every worker; True if the timeout came first. When a rank has exited without an ok
    result, the others (blocked in a collective with it, perhaps) get RANK_GRACE_S to finish."""
    deadline = time.monotonic() + timeout_s
    while any(w.poll() is None for w in workers):
        now = time.monotonic()
        if now > deadline:
            return True
        failed = [i for i, w in enumerate(workers) if w.poll() is not None and not _ok_result(results[i])]
        if failed and len(workers) > 1:
            deadline = min(deadline, now + RANK_GRACE_S)
        time.sleep(0.05)
    return False


def _ok_result(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("status") == "ok"
    except (OSError, ValueError):
        return False


def _run_workers(
    spec: RunSpec, tmp: Path, timeline_dir: Path | None = None, trace_dir: Path | None = None
) -> tuple[ResultRow, str]:
    """spec.nproc worker processes (ranks of one process group when several: runner/ranks.py), their
    merged row and stderr."""
    results = [tmp / (f"result.rank{r}.json" if spec.nproc > 1 else "result.json") for r in range(spec.nproc)]
    timeout_s = point_timeout_s(spec)
    workers: list[Worker] = []
    lines: list[str] = []
    readers = []
    try:
        _terminate_raises()  # a SIGTERM here unwinds into the kill below, as Ctrl-C does
        for r, result_path in enumerate(results):
            env = None
            if spec.nproc > 1:
                env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(spec.nproc)}
                env[INIT_METHOD_ENV] = f"file://{tmp / 'rendezvous'}"
            env = worker_environment(spec.device, spec.seq_len, env)
            group = workers[0].pid if workers else None
            workers.append(_start_worker(spec, result_path, env, group, timeline_dir, trace_dir))
            reader = threading.Thread(target=_read_stderr, args=(workers[-1].stderr, lines), daemon=True)
            reader.start()
            readers.append(reader)
        timed_out = _wait(workers, results, timeout_s)
    except BaseException:  # Ctrl-C or a kill of this process: the workers must not outlive it
        if workers:
            _kill_group(workers)
        raise
    if timed_out or any(w.poll() is None for w in workers):
        _kill_group(workers)
    for reader in readers:
        reader.join()
    stderr = "".join(lines)
    rows = []
    for worker, result_path in zip(workers, results):
        if result_path.exists():
            rows.append(ResultRow(**json.loads(result_path.read_text())))
            continue
        row = ResultRow(**spec_fields(spec))
        if timed_out:
            row.status, row.error = "timeout", f"no result after {timeout_s:g} s (--timeout)"
        elif worker.returncode == -signal.SIGKILL:
            why = "out of host memory?" if spec.nproc == 1 else "another rank failed, or out of host memory?"
            row.status, row.error = "error", f"worker killed by SIGKILL ({why})"
        else:
            reason = _last_error_line(stderr) or "no output"
            row.status, row.error = "error", f"worker exited with code {worker.returncode}: {reason}"
        rows.append(row)
    row = rows[0] if spec.nproc == 1 else merge_rank_rows(rows)
    row.timeout_s = timeout_s
    return row, stderr


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _terminate_raises() -> None:
    """Where SIGTERM would kill this process outright (its default action, as in a test process),
    make it raise SystemExit instead, so the workers are killed on the way out. A handler someone
    else installed (`sbp`'s own) is kept. Only the main thread may set one."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)


def _kill_group(workers: list[Worker]) -> None:
    try:
        os.killpg(workers[0].pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for worker in workers:
        if worker.poll() is None:
            worker.kill()
        worker.wait()


def run_points(
    specs: Iterable[RunSpec],
    out: str | Path | None,
    *,
    measure: Callable[[RunSpec, Environment], ResultRow] = run_isolated,
    timeline: bool = False,
    trace: bool = False,
) -> Iterator[ResultRow]:
    """Measure points one by one; each row is in the CSV (upserted by key) before it is yielded,
    so an interrupted run keeps every finished point. timeline: each point's memory timeline goes
    to timelines/ beside the CSV, named by the row (runner/timelines.py); trace: a profiler trace of
    one step after its timed ones goes to traces/ beside it (runner/traces.py)."""
    envs: dict[str, Environment] = {}
    if timeline:
        assert out is not None, "a timeline is saved beside its results CSV"
        measure = functools.partial(measure, timeline_dir=timelines_beside(out))
    if trace:
        assert out is not None, "a trace is saved beside its results CSV"
        measure = functools.partial(measure, trace_dir=traces_beside(out))
    for spec in specs:
        if spec.device not in envs:
            envs[spec.device] = capture_environment(spec.device)
        env = envs[spec.device]
        row = measure(spec, env)
        if timeline:
            finish_timeline(row, out)
        if trace:
            finish_trace(row, out)
        if out is not None:
            upsert_rows(out, [row])
        yield row
