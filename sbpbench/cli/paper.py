"""The paper's number for a row, for commands that print it alongside ours."""

from __future__ import annotations

from functools import cache

from ..records import ResultRow
from ..records.select import MAXLEN_TABLE, paper_rows


@cache
def _reference():
    from ..records.reference import load_reference

    try:
        return load_reference()
    except (FileNotFoundError, ValueError):  # an installed wheel has no experiments/ folder
        return None


def paper_max_len(row: ResultRow) -> str | None:
    """The paper's max sequence length for this row's setting on one 80 GB GPU (Figure 3 for a
    backpropagation step, Table 3 for a training step), by the rule `sbp report` uses; None where
    the paper has none."""
    reference = _reference()
    if reference is None or row.step not in MAXLEN_TABLE:
        return None
    match = paper_rows(reference, table=MAXLEN_TABLE[row.step], metric="max_seq_len", like=row.as_dict())
    if match.empty:
        return None
    paper = match.iloc[0]
    return "OOM" if paper["status"] != "ok" else f"{int(paper['value']):,}"
