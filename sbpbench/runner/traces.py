"""Profiler traces of measured points (`sbp run --trace`): one step more than the timed ones,
profiled in the worker (measure/trace.py), saved beside the results CSV.

The traced step comes after the timed steps, with the same step function and the same `prepare`,
so the row's times are those of unprofiled steps. A point without timed steps (--repeats 0) is
not traced. Each point's trace has a folder of its own, `traces/<stem>/rank0.json` beside the CSV
(stem: workload/timeline.py `timeline_stem`): HTA reads a folder as the ranks of one run, so
`TraceAnalysis(trace_dir=...)` takes it as it is. The row's `trace_file` names the file, relative to
the CSV's directory, so a results folder moves with its traces.

The parent names the folder in the worker's request (runner/worker.py); the worker holds it while
it measures the point (`tracing_into`), and point.py's `_measure` calls `trace_step` after its
timed steps.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from ..config import RunSpec
from ..measure.trace import profile_step
from ..records import ResultRow
from ..workload.timeline import timeline_stem

TRACES = "traces"  # the folder beside the results CSV
TRACE_FILE = "rank0.json"  # a point is one process: rank 0 of its folder
TRACED_STEP = "traced step"  # its progress label

_FOLDER: ContextVar[Path | None] = ContextVar("trace_folder", default=None)


def trace_dir(out: str | Path) -> Path:
    return Path(out).parent / TRACES


@contextmanager
def tracing_into(folder: str | Path | None) -> Iterator[None]:
    """Points measured inside trace one step each into `folder` (None: no trace)."""
    token = _FOLDER.set(Path(folder) if folder else None)
    try:
        yield
    finally:
        _FOLDER.reset(token)


def trace_step(
    spec: RunSpec,
    row: ResultRow,
    device_type: str,
    prepare: Callable[[str], None],
    run: Callable[[], object],
    synchronize: Callable[[], None],
) -> None:
    """After the timed steps, inside `tracing_into`: prepare and run the step once more under the
    profiler, and name its trace in the row. A trace that fails costs the trace, never the row:
    the traceback goes to the worker's stderr."""
    folder = _FOLDER.get()
    if folder is None:
        return
    try:
        prepare(TRACED_STEP)
        path = profile_step(
            run, folder / timeline_stem(spec) / TRACE_FILE, device_type=device_type, synchronize=synchronize
        )
    except Exception:
        traceback.print_exc()
        return
    row.trace_file = str(path)


def finish(row: ResultRow, out: str | Path) -> None:
    """After the worker: the row names its trace relative to the CSV's directory."""
    if row.trace_file:
        row.trace_file = os.path.relpath(row.trace_file, Path(out).parent)
