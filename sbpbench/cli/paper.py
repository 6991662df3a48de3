"""The paper's number for a row, for commands that print it alongside ours."""

from __future__ import annotations

from functools import cache

from ..records import ResultRow


@cache
def _reference():
    from ..records.reference import load_reference

    try:
        return load_reference()
    except (FileNotFoundError, ValueError):  # an installed wheel has no experiments/ folder
        return None


def paper_max_len(row: ResultRow) -> str | None:
    """The paper's max sequence length for this row's setting on one 80 GB GPU: Figure 3 for a
    backpropagation step, Table 3 for a training step; None where the paper has none."""
    reference = _reference()
    if reference is None:
        return None
    table = "Figure 3" if row.step == "bp" else "Table 3"
    match = reference[
        (reference["table"] == table)
        & (reference["metric"] == "max_seq_len")
        & (reference["model"] == row.model)
        & (reference["method"] == row.method)
        & (reference["objective"] == row.objective)
        & (reference["lora"] == bool(row.lora_rank))
        & (reference["num_gpus"] == 1)
    ]
    if match.empty:
        return None
    paper = match.iloc[0]
    return "OOM" if paper["status"] != "ok" else f"{int(paper['value']):,}"
