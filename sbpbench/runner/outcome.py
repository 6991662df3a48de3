"""What a command's work in the runner ends with, and the lines it says on the way.

A sweep (sweep.py `run_experiment`) and a command's max-length searches (searches.py
`run_searches`) return an Outcome: the rows they made and how they stopped. The CLI turns it
into tables, one line on how it stopped and an exit code (cli/outcomes.py). On the way they report
to a Steps object (cli/progress.py Progress is one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..measure.units import gib
from ..records import ResultRow


class Steps(Protocol):
    """Progress of a command's units of work (a point, a search)."""

    def start(self, text: str) -> None: ...  # a unit begins
    def note(self, line: str) -> None: ...  # a step inside it (a probe, a seed)
    def advance(self, text: str) -> None: ...  # it is done, and how


@dataclass
class Outcome:
    rows: list[ResultRow] = field(default_factory=list)  # this run's points and search answers
    probes: list[ResultRow] = field(default_factory=list)  # the max-length probes it ran (each a row too)
    seeds: list[ResultRow] = field(default_factory=list)  # the searches' seeds it predicted and stored (seeds.py)
    stopped: str = ""  # the budget ran out: where, what is left, how to resume
    failed: str = ""  # a probe failed: what, and where the rows so far are
    interrupted: str = ""  # Ctrl-C: what was kept, how to resume

    @property
    def errors(self) -> bool:
        """A row that says the point went wrong (not an OOM: that is an answer)."""
        return any(row.status in ("error", "timeout") for row in self.rows)


def written_line(outcome: Outcome, out, results: str = "point(s) and answer(s)") -> str:
    """How many rows went to `out`, counted as written (a row of a key written twice is one), the
    probes and the seeds said apart from the `results`."""
    from ..records import row_key

    probes, seeds = {row_key(row) for row in outcome.probes}, {row_key(row) for row in outcome.seeds}
    written = {row_key(row) for row in outcome.rows} | probes | seeds
    line = f"{len(written)} row(s) written to {out}"
    if probes or seeds:
        line += f": {len(written - probes - seeds)} {results}, {len(probes)} probe(s)"
        line += f", {len(seeds)} seed(s)" if seeds else ""
    return line


def point_line(row: ResultRow) -> str:
    """How a finished point ended, in one line."""
    line = f"{row.method} T={row.seq_len}: {row.status}"
    if row.status == "oom" and (row.error or "").startswith("host:"):  # a predicted host, not the GPU, is too small
        line += f" ({row.error})"
    if row.peak_allocated_bytes is not None:
        line += f", peak {gib(row.peak_allocated_bytes)} GiB"
    if row.time_median_s is not None:
        line += f", {row.time_median_s:.3f} s/step"
    return line


def seq_bound(row: ResultRow) -> str:
    """A search's answer in words: its status where it has no length (unsupported, error)."""
    if row.status != "ok" or (row.max_seq_len is None and row.oom_seq_len is None):
        return row.status
    if row.max_seq_len is None:
        return f"< {row.oom_seq_len:,}"
    return f"{row.max_seq_len:,}" if row.oom_seq_len is not None else f">= {row.max_seq_len:,} (ceiling)"
