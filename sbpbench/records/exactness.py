"""The exactness table: what `sbp check --out FILE` measured, one row per method compared with
standard BP on one model and batch, so that `sbp report --exactness FILE` shows by how much each
method differs (a peer that is not exact is recorded, never assumed either way).

A CSV of its own (not the results schema): a row is a comparison, not a measured point. Errors are
relative, max |ours - bp| / max |bp| (methods/exactness.py); result is exact | differs | unsupported.
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .store import RowsNotSaved, check_writable, csv_header, keep_unsaved


@dataclass(kw_only=True)
class ExactnessRow:
    timestamp_utc: str = ""
    method: str = ""
    reference: str = "bp"
    result: str = ""  # exact | differs | unsupported
    loss_rel_error: float | None = None
    grad_rel_error: float | None = None  # the worst parameter's
    worst_tensor: str = ""
    tolerance: float | None = None
    note: str = ""  # unsupported: why
    model: str = ""
    num_layers: int | None = None
    objective: str = ""
    lora_rank: int | None = None
    dtype: str = ""
    batch_size: int | None = None
    seq_len: int | None = None
    settings: str = ""  # the method's settings, "name=value" joined by spaces
    device: str = ""
    torch_version: str = ""
    transformers_version: str = ""
    git_commit: str = ""
    git_dirty: str = ""


EXACTNESS_COLUMNS = tuple(f.name for f in fields(ExactnessRow))
# what a file must have to be appended to: a header without them is another program's CSV
REQUIRED_EXACTNESS_COLUMNS = ("method", "reference", "result")


def check_exactness_writable(path: str | Path) -> Path:
    """Fail before the comparison runs if `path` cannot take exactness rows (records.store.check_writable)."""
    return check_writable(path, required=REQUIRED_EXACTNESS_COLUMNS, kind="exactness CSV")


def write_exactness(path: str | Path, rows: list[ExactnessRow]) -> None:
    """Append rows (the header once), under the file's own header if it has one (an older file
    keeps its columns aligned). If the write fails, the rows go to a file beside it and
    RowsNotSaved names that file."""
    path = Path(path)
    values = [asdict(r) for r in rows]
    try:
        check_exactness_writable(path)
        header = csv_header(path)
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header or EXACTNESS_COLUMNS, extrasaction="ignore")
            if not header:
                writer.writeheader()
            writer.writerows(values)
    except (OSError, ValueError) as error:
        kept = keep_unsaved(path, EXACTNESS_COLUMNS, values)
        raise RowsNotSaved(f"{error}; the {len(values)} comparison(s) are kept in {kept}") from None


def read_exactness(path: str | Path) -> list[dict[str, str]]:
    """The rows of an exactness CSV, every column present ("" where an older file lacks it);
    ValueError (one line) for a CSV without the required columns or with a non-numeric error."""
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED_EXACTNESS_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(
                f"{path} is not an exactness CSV: it lacks the column(s) {', '.join(missing)}; "
                "give one written by `sbp check --out`"
            )
        rows = [dict.fromkeys(EXACTNESS_COLUMNS, "") | {k: v or "" for k, v in r.items() if k} for r in reader]
    for line, row in enumerate(rows, start=2):
        for column in ("loss_rel_error", "grad_rel_error", "tolerance"):
            try:
                float(row[column] or 0)
            except ValueError:
                raise ValueError(
                    f"{path} line {line}, column {column}: {row[column]!r} is not a number; fix or remove that line"
                ) from None
    return rows
