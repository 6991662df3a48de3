"""Results CSV files: atomic upsert by key, reading back, loading into pandas.

A write never edits the file in place: the whole table goes to a temporary file in the same
directory, is fsynced, and replaces the old one with os.replace (atomic on POSIX). A process killed
at any moment leaves either the old table or the new one, never a torn row. A lock file beside
the CSV serialises concurrent writers (read-modify-write would otherwise lose rows).
"""

from __future__ import annotations

import csv
import fcntl
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

from .schema import COLUMNS, KEY_COLUMNS, ResultRow, upgrade


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:500]


def encode(value) -> str:
    """How a value is written to the CSV (and compared in keys): None empty, bools lower case,
    floats with full precision."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def decode_row(values: dict[str, str]) -> ResultRow:
    """A CSV row (strings, as read_rows gives it) back as a ResultRow; unknown columns dropped."""
    row = ResultRow()
    for f in fields(ResultRow):
        text = values.get(f.name, "")
        if text == "":
            value = None if "None" in str(f.type) else ""
        elif f.type.startswith("int"):
            value = int(float(text))
        elif f.type.startswith("float"):
            value = float(text)
        elif f.type.startswith("bool"):
            value = text == "true"
        else:
            value = text
        setattr(row, f.name, value)
    return row


def encode_row(row: ResultRow | dict) -> dict[str, str]:
    return {c: encode(v) for c, v in (row.as_dict() if isinstance(row, ResultRow) else row).items()}


def row_key(row: ResultRow | dict) -> tuple[str, ...]:
    """The point a row measured: its KEY_COLUMNS values as written to the CSV."""
    encoded = encode_row(row)
    return tuple(encoded.get(column, "") for column in KEY_COLUMNS)


def check_writable(path: str | Path) -> Path:
    """Fail before any work is done if the results file cannot be written."""
    path = Path(path)
    if path.exists() and path.is_dir():
        raise ValueError(f"{path} is a directory; pass a CSV file path such as {path / 'runs.csv'}")
    if path.suffix.lower() != ".csv":
        raise ValueError(f"results go to a .csv file, got {path}; pass e.g. --out results/runs.csv")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise PermissionError(f"cannot create {path.parent} ({error.strerror}); pass a writable --out path") from None
    target = path if path.exists() else path.parent
    if not os.access(target, os.W_OK) or not os.access(path.parent, os.W_OK):
        raise PermissionError(f"cannot write {path} (no write permission); pass a writable --out path")
    return path


def read_rows(path: str | Path) -> list[dict]:
    """Rows as dicts of strings, each as the current schema reads it (schema.upgrade). Rows that
    an upgrade makes one point (the same key) are one row: the latest by timestamp."""
    path = Path(path)
    if not path.exists():
        return []
    with path.open(newline="") as f:
        rows = [upgrade({k: (v or "") for k, v in row.items() if k is not None}) for row in csv.DictReader(f)]
    latest: dict[tuple[str, ...], int] = {}
    for i, row in enumerate(rows):
        j = latest.setdefault(row_key(row), i)
        if j != i and row.get("timestamp_utc", "") >= rows[j].get("timestamp_utc", ""):
            latest[row_key(row)] = i
    kept = set(latest.values())
    return [row for i, row in enumerate(rows) if i in kept]


def _columns_of(path: Path) -> list[str]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return next(csv.reader(f), [])


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    lock = path.with_name(f".{path.name}.lock")
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_atomic(path: Path, columns: list[str], rows: list[dict]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def upsert_rows(path: str | Path, rows: Iterable[ResultRow | dict], *, replace: bool = True) -> None:
    """Add rows to the CSV; a row whose key is already there replaces it (replace=True) or is
    dropped (replace=False). Columns in the file that this schema does not know are kept."""
    path = check_writable(path)
    new = [encode_row(r) for r in rows]
    with _locked(path):
        existing = read_rows(path)
        columns = list(COLUMNS) + [c for c in _columns_of(path) if c not in COLUMNS]
        index = {row_key(row): i for i, row in enumerate(existing)}
        for row in new:
            i = index.get(row_key(row))
            if i is None:
                index[row_key(row)] = len(existing)
                existing.append(row)
            elif replace:
                existing[i] = row
        _write_atomic(path, columns, existing)


def completed_keys(path: str | Path) -> set[tuple[str, ...]]:
    """Keys of the points already in a results file (for resuming)."""
    return {row_key(row) for row in read_rows(path)}


def _numeric(table):
    """Columns whose every non-empty value is a number become numeric (empty -> NaN)."""
    import pandas as pd

    for column in table.columns:
        values = table[column].replace("", None)
        converted = pd.to_numeric(values, errors="coerce")
        if converted.notna().sum() == values.notna().sum():
            table[column] = converted
    return table


def load_results(source: str | Path):
    """A results CSV, or every CSV under a directory, as one pandas DataFrame in schema column order."""
    import pandas as pd

    source = Path(source)
    files = sorted(source.rglob("*.csv")) if source.is_dir() else [source]
    if not files or not all(f.exists() for f in files):
        raise FileNotFoundError(f"no results CSV at {source}; run `sbp run --out {source}` first")
    rows = [{**row, "source_file": str(f)} for f in files for row in read_rows(f)]  # read_rows upgrades old rows
    table = pd.DataFrame(rows).fillna("")
    table = _numeric(table)
    ordered = [c for c in COLUMNS if c in table.columns]
    return table[ordered + [c for c in table.columns if c not in ordered]]
