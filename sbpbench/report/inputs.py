"""What `sbp plot` and `sbp report` read: the results table and, if it can be found, the paper's."""

from __future__ import annotations

from pathlib import Path

from ..records import load_results, results_file
from ..records.reference import DEFAULT_REFERENCE, load_reference
from ..records.schema import RESULT_KINDS


def load_table(results: Path):
    """The results table, less a sweep's seed rows (predictions it starts its searches from, not
    results); a missing, empty or header-only file is a user error saying what to run."""
    table = load_results(results, kinds=RESULT_KINDS)
    if table.empty or "kind" not in table.columns:
        raise ValueError(f"no result rows in {results}; measure first, e.g. `sbp run --out {results_file(results)}`")
    return table


def load_paper(reference: Path | None):
    """(reference table or None, a one-line note when the default one is missing). An explicit path
    that does not exist is an error; the repository's default missing only costs the comparison."""
    if reference is not None or DEFAULT_REFERENCE.is_file():
        return load_reference(reference), ""
    return None, f"note: no paper reference at {DEFAULT_REFERENCE}; without the paper's numbers (pass --reference)"
