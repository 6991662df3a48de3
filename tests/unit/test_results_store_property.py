"""A property of the results store: no sequence of runs, reruns and interrupted writes loses an ok row."""

from __future__ import annotations

import csv
import tempfile
from pathlib import Path
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from sbpbench.records import ResultRow, RowsNotSaved, read_rows, upsert_rows
from sbpbench.records.store import FAILED_RERUN

SEQ_LENS = (8, 16, 32)  # three points
OUTCOMES = ("ok", "oom", "error", "timeout")
INTERRUPTS = (None, OSError, KeyboardInterrupt)  # a write that raises midway: a full disk, a Ctrl-C

runs = st.lists(
    st.tuples(st.sampled_from(SEQ_LENS), st.sampled_from(OUTCOMES), st.sampled_from(INTERRUPTS)),
    min_size=1,
    max_size=8,
)


def _interrupting(error: type[BaseException]):
    """A DictWriter.writerows that writes half the rows, then raises `error` (once: the rows kept
    beside the file after a failed write are written whole)."""
    real, calls = csv.DictWriter.writerows, []

    def writerows(self, rows):
        rows = list(rows)
        if calls:
            return real(self, rows)
        calls.append(1)
        real(self, rows[: len(rows) // 2])
        raise error("interrupted mid-write")

    return mock.patch.object(csv.DictWriter, "writerows", writerows)


def _run(path: Path, step: int, seq_len: int, outcome: str, interrupt) -> bool:
    """One point's row upserted (its loss the step, to tell measurements apart); whether it was written."""
    row = ResultRow(model="tiny/qwen3", method="bp", seq_len=seq_len, status=outcome, device_name="cpu")
    row.loss, row.timestamp_utc = float(step), f"2025-01-01T00:00:{step:02d}+00:00"
    row.error = "" if outcome == "ok" else f"{outcome} at step {step}"
    if interrupt is None:
        upsert_rows(path, [row])
        return True
    try:
        with _interrupting(interrupt):
            upsert_rows(path, [row])
    except (RowsNotSaved, KeyboardInterrupt):
        return False
    raise AssertionError("an interrupted write did not raise")


@settings(max_examples=25, deadline=None, database=None)
@given(runs)
def test_no_run_rerun_or_interrupted_write_loses_an_ok_row(steps):
    """After every step the file parses, holds one row per point run, and a point measured ok keeps
    its latest ok measurement whatever failed or was interrupted after it."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "r.csv"
        latest_ok: dict[int, float] = {}
        latest: dict[int, str] = {}
        for step, (seq_len, outcome, interrupt) in enumerate(steps):
            if _run(path, step, seq_len, outcome, interrupt):
                latest[seq_len] = outcome
                if outcome == "ok":
                    latest_ok[seq_len] = float(step)
            rows = {int(r["seq_len"]): r for r in read_rows(path)}  # parses, or raises
            assert set(rows) == set(latest)
            for seq_len, row in rows.items():
                if seq_len in latest_ok:
                    assert (row["status"], float(row["loss"])) == ("ok", latest_ok[seq_len])
                    assert (row["error"].startswith(FAILED_RERUN)) == (latest[seq_len] != "ok")
                else:
                    assert row["status"] == latest[seq_len]
            assert not list(Path(folder).glob(".r.csv*")), "a temporary or lock file was left"
