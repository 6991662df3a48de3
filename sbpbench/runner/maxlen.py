"""`sbp maxlen`'s search with real probes: each probe is one `sbp run` point (isolated process,
status ok or oom), upserted to the results CSV as it finishes, so an interrupted search resumes
from the CSV. The answer is one more row: kind maxlen, with the longest ok and shortest OOM, the
seed the search started from (a predicted max T, `seed`) and every answer it used, in order.

A probe that times out stops the search (ProbeFailed), as an error does, and is not taken as an
upper bound: the answer is read as a memory limit (the paper's max T, the ratio to ckpt), and a
length cut by time says nothing about memory. A probe is one memory step and its timeout is the
FLOP model's, with a wide margin (timeout.py), so a timeout is a hung or starved machine: the
message says to rerun with a larger --timeout, and the probes so far are kept for the resume. A
sweep records such a search as an error (`failed_row`) and goes on. (A sweep's grid, which
answers no such question, skips the longer points of a timed-out series.)"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

from ..config import MaxlenSpec, RunSpec
from ..measure.environment import Environment, capture_environment
from ..records import ResultRow, decode_row, read_rows, row_key, upsert_rows
from ..records.select import is_oom
from ..workload.rows import provenance, spec_fields, spec_key
from .isolated import run_isolated
from .length_search import Probe, answered, search_max_len

Measure = Callable[[RunSpec, Environment], ResultRow]
# The predicted longest fit for a search's probes (`sbp estimate`'s, run by the caller: the runner
# does not import the estimator), or None for no prediction (the search then grows blind).
Seed = Callable[[MaxlenSpec], int | None]


class ProbeFailed(RuntimeError):
    """A probe ended in error or timeout: memory says nothing about that length."""


def probe_answer(row: dict) -> bool | None:
    """A probe row's answer: True (ok), False (out of memory, or skipped as certain to be), None (no
    answer: an error, a timeout, a point skipped as certain to time out)."""
    if row["status"] == "ok":
        return True
    return False if is_oom(row) else None


class _Unsupported(Exception):
    """A probe's method cannot run here at all: the search's answer is that, at any length."""

    def __init__(self, row: ResultRow):
        super().__init__(row.error)
        self.row = row


def cached_probes(search: MaxlenSpec, out, *, device_name: str, source: str = "measured") -> dict[int, ResultRow]:
    """Probe rows already in the CSV for this search, with an answer: each with the key its own
    length's probe gives (chunk sizes left to the rule, "auto", are the rule's at that length)."""
    if out is None:
        return {}
    found = {}
    for row in read_rows(out):
        if probe_answer(row) is None or not row.get("seq_len"):
            continue
        seq_len = int(row["seq_len"])
        if row_key(row) == spec_key(search.probe(seq_len), device_name=device_name, source=source):
            found[seq_len] = decode_row(row)
    return found


def probe_record(probes: list[Probe]) -> str:
    """The answers a search used, in order: "61440:ok 62464:oom", with "(cached)" after one no probe
    of this search ran (an earlier run's row, or settled by a longer ok or a shorter OOM)."""
    return " ".join(f"{p.seq_len}:{'ok' if p.fits else 'oom'}{'' if p.ran else '(cached)'}" for p in probes)


def maxlen_row(
    search: MaxlenSpec, result, probe_rows: dict[int, ResultRow], seed_seq_len: int | None = None
) -> ResultRow:
    """The answer as a row: the probe settings, kind maxlen, no seq_len, the seed and the probes,
    and the memory columns of the longest ok probe."""
    # a probe of this search (the latest) gives every column but the probe's own length and numbers
    template = max(probe_rows.values(), key=lambda r: r.timestamp_utc)
    row = ResultRow(**{**template.as_dict(), "warmup_steps": search.base.warmup, "repeats": search.base.repeats})
    row.kind, row.seq_len, row.error = "maxlen", None, ""
    row.status = "ok" if result.max_ok is not None else "oom"
    if result.max_ok is None:
        shortest = probe_rows.get(result.min_oom)
        host = shortest.error if shortest is not None and (shortest.error or "").startswith("host:") else ""
        row.error = f"even T={result.min_oom} does not fit" + (f": {host}" if host else "")
    row.max_seq_len, row.oom_seq_len = result.max_ok, result.min_oom
    row.search_resolution, row.num_probes = str(search.resolution), len(result.probes)
    row.seed_seq_len, row.search_probes = seed_seq_len, probe_record(result.probes)
    best = probe_rows.get(result.max_ok)
    for column in ("loss", "num_tokens", "time_median_s", "time_min_s", "time_max_s", "tokens_per_s", "tflops_per_s"):
        setattr(row, column, None)
    for column in (
        "peak_allocated_bytes",
        "activation_peak_bytes",
        "peak_reserved_bytes",
        "nvml_peak_used_bytes",
        "margin_bytes",
    ):
        setattr(row, column, None if best is None else getattr(best, column))
    row.peak_phase = "" if best is None else best.peak_phase
    row.timestamp_utc = datetime.now(UTC).isoformat(timespec="seconds")
    return row


def failed_row(search: MaxlenSpec, env: Environment, error: ProbeFailed) -> ResultRow:
    """A search that a probe stopped, as its answer row: kind maxlen, status error, the probe's
    message. Not done: the next run resumes the search from its probes."""
    row = ResultRow(**spec_fields(search.base), **provenance(env))
    row.kind, row.seq_len, row.status = "maxlen", None, "error"
    row.error = f"{error}; the probes so far are kept"
    row.search_resolution = str(search.resolution)
    row.timestamp_utc = datetime.now(UTC).isoformat(timespec="seconds")
    return row


def find_max_len(
    search: MaxlenSpec,
    out,
    *,
    measure: Measure = run_isolated,
    env: Environment | None = None,
    device_name: str | None = None,
    source: str = "measured",
    resume: bool = True,
    on_probe: Callable[[ResultRow], None] | None = None,
    seed: Seed | None = None,
    first_multiple: int | None = None,
) -> ResultRow:
    """Search, probing through `measure` (a real isolated run, or a simulation), and upsert the
    probes and the answer row to `out`. on_probe(row) sees each probe that ran (not the cached
    ones). seed: where the search starts (length_search.py), asked only when
    search.seed_from_estimate and the cached answers leave something open. first_multiple: probe
    first only lengths that are multiples of it (a simulated search's, whose short runs they
    share), then the rest of the bracket at search.multiple_of."""
    env = env or capture_environment(search.base.device)
    device_name = device_name if device_name is not None else env.device_name
    rows = cached_probes(search, out, device_name=device_name, source=source) if resume else {}

    def answers() -> dict[int, bool]:
        return {seq_len: probe_answer(row.as_dict()) for seq_len, row in rows.items()}

    def probe(seq_len: int) -> bool:
        row = measure(search.probe(seq_len), env)
        if out is not None:
            upsert_rows(out, [row])
        rows[seq_len] = row
        if on_probe:
            on_probe(row)
        if row.status == "unsupported":
            raise _Unsupported(row)
        answer = probe_answer(row.as_dict())
        if answer is None:
            hint = "; a max length is a memory answer: rerun with a larger --timeout" if row.status == "timeout" else ""
            raise ProbeFailed(f"{search.method} at T={seq_len}: {row.status}: {row.error}{hint}")
        return answer

    bounds = {"ceiling": search.seq_len_ceiling, "resolution": search.resolution}
    still_open = not answered(answers(), **bounds, multiple_of=search.multiple_of)
    seed_seq_len = seed(search) if seed is not None and search.seed_from_estimate and still_open else None
    try:
        first = None
        if first_multiple is not None and first_multiple > search.multiple_of:
            first = search_max_len(probe, start=search.start, cached=answers(), multiple_of=first_multiple, **bounds)
        result = search_max_len(
            probe,
            start=search.start,
            cached=answers(),
            multiple_of=search.multiple_of,
            seed=seed_seq_len,
            **bounds,
        )
        if first is not None:  # the second pass read the first's answers: the search used both passes'
            result.probes = first.probes + [p for p in result.probes if p.ran]
    except _Unsupported as refused:  # the answer row says so, with the reason
        answer = ResultRow(**{**refused.row.as_dict(), "kind": "maxlen", "seq_len": None, "num_probes": 1})
        answer.search_resolution = str(search.resolution)
    else:
        answer = maxlen_row(search, result, rows, seed_seq_len)
    if out is not None:
        upsert_rows(out, [answer])
    return answer
