"""`sbp sweep`: an experiment's points one by one, each isolated, resumable from its results CSV.

Every finished point is upserted to the CSV before the next starts (atomic writes), so a Ctrl-C
or a SIGKILL loses at most the point in flight, and a rerun skips what the CSV already holds
(same key). A point is certain OOM, and recorded as `skipped` without running, when a point of
the same settings with no longer sequence and no larger batch already ran out of memory; likewise
certain to time out when such a point timed out: a timeout is predicted from the point's FLOPs
(timeout.py), so a machine that missed it at T is too slow by the same factor at longer T, and
the longer points of the series are not run for their full (longer) timeouts.

A search stopped by a failed probe is recorded as an error (maxlen.py `failed_row`) and the sweep
goes on. Under a budget with a cost model (budget.py `within`), a point predicted not to finish in
what is left is not started: the sweep goes on with the next job and a later command runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from ..config import MaxlenSpec, RunSpec
from ..measure.environment import Environment, capture_environment
from ..records import KEY_COLUMNS, ResultRow, read_rows, row_key, upsert_rows
from ..records.schema import SKIPPED_OOM, SKIPPED_TIMEOUT
from ..records.select import is_oom
from ..workload.rows import provenance, spec_fields, spec_key
from .budget import NotStarted
from .isolated import run_isolated
from .maxlen import Measure, ProbeFailed, Seed, failed_row, find_max_len

# Rows a resumed sweep keeps; an error is retried (a fixed bug or a freed device may cure it).
DONE_STATUSES = ("ok", "oom", "skipped", "timeout", "unsupported")


@dataclass
class Job:
    """One unit of a sweep: a grid point or a whole max-length search."""

    point: RunSpec | MaxlenSpec
    key: tuple[str, ...]
    done: bool = False  # already in the CSV (resume)

    @property
    def spec(self) -> RunSpec:
        return self.point.base if isinstance(self.point, MaxlenSpec) else self.point

    def describe(self) -> str:
        spec = self.spec
        where = f"{spec.model}, {spec.method}"
        if spec.objective != "sft" or spec.lora_rank:
            where += f", {spec.objective}" + (f" LoRA r{spec.lora_rank}" if spec.lora_rank else "")
        if isinstance(self.point, MaxlenSpec):
            return f"max T: {where}"
        return f"{where}, T={spec.seq_len}, B={spec.batch_size}"


def _oom_group(key: tuple[str, ...]) -> tuple[str, ...]:
    """A key without seq_len and batch_size: the points among which an OOM is monotone."""
    drop = {KEY_COLUMNS.index("seq_len"), KEY_COLUMNS.index("batch_size")}
    return tuple(v for i, v in enumerate(key) if i not in drop)


def plan(points, out, *, device_name: str, resume: bool = True) -> list[Job]:
    """The sweep's jobs in file order, duplicates (same key) dropped, those in the CSV marked done."""
    rows = [r for r in read_rows(out) if r.get("status") in DONE_STATUSES] if resume and out else []
    done = {row_key(r): r for r in rows}
    jobs, seen = [], set()
    for point in points:
        if isinstance(point, MaxlenSpec):
            key = spec_key(point.base, device_name=device_name, kind="maxlen")
            finished = key in done and not _below_new_ceiling(done[key], point.seq_len_ceiling)
        else:
            key = spec_key(point, device_name=device_name)
            finished = key in done
        if key in seen:
            continue
        seen.add(key)
        jobs.append(Job(point, key, done=finished))
    return jobs


def _below_new_ceiling(answer: dict, ceiling: int) -> bool:
    """A search that stopped at its ceiling without an OOM answered "at least max T": with a higher
    ceiling now, it is not done (its probes are cached, so only the longer ones run)."""
    if answer.get("status") != "ok" or answer.get("oom_seq_len") not in (None, ""):
        return False
    reached = answer.get("max_seq_len")
    return reached not in (None, "") and int(reached) < ceiling


class _Bounds:
    """The (seq_len, batch) points of each settings group that ran out of memory or timed out: a
    point of the group with no shorter T and no smaller batch would too."""

    def __init__(self, rows: list[dict]):
        self.bounds: dict[tuple, list[tuple[int, int, str]]] = {}
        for row in rows:
            outcome = _bound(row)
            if row.get("kind", "point") == "point" and outcome and row.get("seq_len"):
                self.add(row_key(row), int(row["seq_len"]), int(row["batch_size"] or 1), outcome)

    def add(self, key, seq_len: int, batch_size: int, outcome: str) -> None:
        self.bounds.setdefault(_oom_group(key), []).append((seq_len, batch_size, outcome))

    def certain(self, key, seq_len: int, batch_size: int) -> tuple[int, int, str] | None:
        """A point that proves this one runs out of memory (outcome "oom") or time ("timeout"), if
        any; an OOM proof first (it says more)."""
        proofs = [b for b in self.bounds.get(_oom_group(key), []) if b[0] <= seq_len and b[1] <= batch_size]
        return min(proofs, key=lambda b: b[2] != "oom", default=None)


def _bound(row: dict) -> str | None:
    """ "oom", "timeout" or None: what a row proves of the longer points of its group."""
    if is_oom(row):
        return "oom"
    return "timeout" if row.get("status") in ("timeout", "skipped") else None


def skipped_row(spec: RunSpec, env: Environment, proof: tuple[int, int, str]) -> ResultRow:
    row = ResultRow(**spec_fields(spec))
    row.status = "skipped"
    seq_len, batch, outcome = proof
    if outcome == "oom":
        row.error = f"{SKIPPED_OOM}: T={seq_len}, batch {batch} already ran out of memory; not run"
    else:
        row.error = f"{SKIPPED_TIMEOUT}: T={seq_len}, batch {batch} timed out; not run"
    for name, value in provenance(env).items():
        setattr(row, name, value)
    row.timestamp_utc = datetime.now(UTC).isoformat(timespec="seconds")
    return row


def _search(job: Job, out, measure: Measure, env: Environment, on_probe, seed: Seed | None) -> ResultRow:
    """A maxlen job's answer row; an error row where a probe failed."""

    def told(row: ResultRow) -> None:
        if on_probe:
            on_probe(job, row)

    try:
        return find_max_len(job.point, out, measure=measure, env=env, on_probe=told, seed=seed)
    except ProbeFailed as error:
        return failed_row(job.point, env, error)


def run_sweep(
    jobs: list[Job],
    out,
    *,
    measure: Measure = run_isolated,
    env: Environment | None = None,
    on_start: Callable[[Job], None] | None = None,
    on_probe: Callable[[Job, ResultRow], None] | None = None,
    on_done: Callable[[Job, ResultRow], None] | None = None,
    on_deferred: Callable[[Job, NotStarted], None] | None = None,
    seed: Seed | None = None,
) -> list[ResultRow]:
    """Run the jobs not yet done, in order; each result is in `out` before the next job starts.
    A maxlen job's probes are cached in `out` too, and it starts from `seed` where its
    seed_from_estimate says so (runner/maxlen.py); a failed probe makes its answer an error row.
    A job whose point `measure` did not start (NotStarted) goes to on_deferred, and the sweep goes
    on (without on_deferred, NotStarted stops it). Returns the new rows (answers, not probes)."""
    todo = [job for job in jobs if not job.done]
    if not todo:
        return []
    env = env or capture_environment(todo[0].spec.device)
    # An earlier OOM proves a longer point OOMs, but a point being run again proves nothing about itself.
    rerun = {job.key for job in todo}
    bounds = _Bounds([r for r in read_rows(out) if row_key(r) not in rerun] if out else [])
    rows = []
    for job in todo:
        if on_start:
            on_start(job)
        try:
            if isinstance(job.point, MaxlenSpec):
                row = _search(job, out, measure, env, on_probe, seed)
            else:
                proof = bounds.certain(job.key, job.point.seq_len, job.point.batch_size)
                row = skipped_row(job.point, env, proof) if proof else measure(job.point, env)
        except NotStarted as why:
            if on_deferred is None:
                raise
            on_deferred(job, why)
            continue
        if out is not None:
            upsert_rows(out, [row])
        if isinstance(job.point, RunSpec) and row.status in ("oom", "timeout"):
            bounds.add(job.key, job.point.seq_len, job.point.batch_size, row.status)
        rows.append(row)
        if on_done:
            on_done(job, row)
    return rows
