"""Memory timelines of measured points (`sbp run --timeline`): recorded in the worker's memory step,
saved beside the results CSV, and predicted for the same point by the estimator.

Files go to `timelines/` beside the CSV, named by the point (workload/timeline.py `timeline_stem`):
`<stem>.measured.json`, `<stem>.predicted.json` and on a GPU `<stem>.snapshot.pickle` (PyTorch's raw
memory snapshot, for pytorch.org/memory_viz). The row's `timeline_file` names the measured one,
relative to the CSV's directory, so a results folder moves with its timelines.
"""

from __future__ import annotations

import os
import traceback
from contextlib import contextmanager
from pathlib import Path

from ..config import RunSpec
from ..measure.host_memory import rss_bytes
from ..measure.timeline.cuda import CudaTimeline
from ..measure.timeline.data import Timeline, load_timeline
from ..measure.timeline.tracked import TrackedTimeline
from ..methods.memory_marks import marking
from ..methods.step import TrainingStep
from ..records import ResultRow
from ..workload.timeline import MEASURED, PREDICTED, SNAPSHOT, point_of, timeline_stem

TIMELINES = "timelines"  # the folder beside the results CSV


def timeline_dir(out: str | Path) -> Path:
    return Path(out).parent / TIMELINES


def marked(recorder, step: TrainingStep):
    """The recorder told the step's phases, kinds and host memory (methods/memory_marks.py)."""
    return marking(recorder, step, rss_bytes)


def status_of(error: BaseException | None, is_out_of_memory) -> str:
    if error is None:
        return "ok"
    return "oom" if is_out_of_memory(error) else "error"


@contextmanager
def _kept_going():
    """A timeline that cannot be saved costs the timeline, never the measurement (or, in the finally
    block of a failed step, its error): the traceback goes to the worker's stderr."""
    try:
        yield
    except Exception:
        traceback.print_exc()


def save_cpu(recorder: TrackedTimeline, spec: RunSpec, row: ResultRow, folder: Path, status: str) -> None:
    with _kept_going():
        timeline = recorder.timeline(
            point=point_of(row), capacity_bytes=row.memory_limit_effective_bytes, status=status
        )
        _save(timeline, spec, row, folder)


def save_cuda(recorder: CudaTimeline, spec: RunSpec, row: ResultRow, folder: Path, status: str) -> None:
    with _kept_going():
        _save_cuda(recorder, spec, row, folder, status)


def _save_cuda(recorder: CudaTimeline, spec: RunSpec, row: ResultRow, folder: Path, status: str) -> None:
    stem = timeline_stem(spec)
    snapshot = recorder.save_snapshot(folder / (stem + SNAPSHOT))
    timeline = recorder.timeline(
        row.baseline_bytes, point=point_of(row), capacity_bytes=row.memory_limit_effective_bytes,
        allocator_peak_bytes=row.peak_allocated_bytes, snapshot=snapshot.name, status=status,
    )  # fmt: skip
    _save(timeline, spec, row, folder)


def _save(timeline: Timeline, spec: RunSpec, row: ResultRow, folder: Path) -> None:
    row.timeline_file = str(timeline.save(Path(folder) / (timeline_stem(spec) + MEASURED)))


def finish(row: ResultRow, out: str | Path) -> None:
    """After the worker: the timeline takes the row's provenance (device name, the kernels that ran),
    and the row names it relative to the CSV's directory."""
    if not row.timeline_file:
        return
    path = Path(row.timeline_file)
    timeline = load_timeline(path)
    timeline.point = point_of(row)
    timeline.save(path)
    row.timeline_file = os.path.relpath(path, Path(out).parent)


def predict_beside(spec: RunSpec, row: ResultRow, out: str | Path) -> Timeline | str:
    """The estimator's timeline of the row's point (simulate/timeline.py), saved beside the measured
    one: target cpu for a CPU point (the tracker's count, to the byte), cuda for a GPU's. Where the
    estimator cannot walk the point (a kernel it does not model), the reason instead: the
    measurement stands without its prediction."""
    from ..simulate.timeline import predicted_timeline

    assert row.timeline_file, "a prediction goes beside a measured timeline"
    path = Path(out).parent / Path(row.timeline_file).with_name(timeline_stem(spec) + PREDICTED)
    target = "cpu" if spec.device == "cpu" else "cuda"
    try:
        timeline = predicted_timeline(spec, target=target)
    except Exception as error:
        path.unlink(missing_ok=True)  # an earlier run's prediction is not this one's
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    timeline.point = {**point_of(row), "device_name": "simulated CPU" if target == "cpu" else "simulated GPU"}
    timeline.capacity_bytes = row.memory_limit_effective_bytes
    timeline.save(path)
    return timeline


def measured_and_predicted(row: dict | ResultRow, base: str | Path) -> tuple[Timeline, Timeline | None]:
    """The timelines a row names (relative to `base`, its CSV's directory): measured, and the
    prediction beside it if there is one."""
    name = row["timeline_file"] if isinstance(row, dict) else row.timeline_file
    path = Path(base) / name
    predicted = path.with_name(path.name.removesuffix(MEASURED) + PREDICTED)
    return load_timeline(path), load_timeline(predicted) if predicted.is_file() else None
