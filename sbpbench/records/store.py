"""Results CSV files: atomic upsert by key, reading back, loading into pandas.

A write never edits the file in place: the whole table goes to a temporary file in the same
directory, is fsynced, and replaces the old one with os.replace (atomic on POSIX), with the mode
the umask gives a new file (an existing file keeps its own). A process killed at any moment
leaves either the old table or the new one, never a torn row. A lock file beside the CSV
serialises concurrent writers (read-modify-write would otherwise lose rows); its holder removes
it, and one left by a killed process is stale (no process holds its flock) and removed by the
next writer. Raw fcntl, not the `filelock` package: its FileLock keeps the lock file after release
(to keep waiters on one inode); here a waiter re-checks the inode instead, so no file is left.

Reading checks every row against the schema (parse.py) and refuses a file it cannot read whole:
not a results CSV, of a newer schema, or damaged (ValueError naming the file, line and column). A
file read in part would be rewritten without what was not read. check_writable reads the file the
same way before any work, and a write that fails all the same keeps its new rows in a file beside
(RowsNotSaved).

Rows are keyed by their point (KEY_COLUMNS), one row per key. A rerun replaces its point's row,
but a failed one (any status but ok) never replaces an ok row: the ok row stays, and its error
column says when the rerun failed and how (`stored_row`).
"""

from __future__ import annotations

import csv
import errno
import fcntl
import os
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

from .parse import check_header, read_records
from .schema import COLUMNS, KEY_COLUMNS, REQUIRED_COLUMNS, ResultRow, upgrade


class ResultsFileWarning(UserWarning):
    """A results CSV under a folder that could not be read and was skipped."""


class NotWritable(OSError):
    """An output file that cannot be written for a reason other than permission (a file system
    that takes no new files, such as /proc; a read-only one): the message says which and what to do."""


class RowsNotSaved(OSError):
    """A write that failed after rows were measured; the message names the file that keeps them."""


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


def check_writable(
    path: str | Path, *, required: tuple[str, ...] = REQUIRED_COLUMNS, kind: str = "results CSV"
) -> Path:
    """Fail before any work is done if the CSV cannot be written: not a .csv name, a directory,
    a folder that cannot be created or written, or an existing file that is not a `kind` (lacks
    `required`), or for a results CSV one that read_rows refuses: rows upserted into it would be
    lost at the end of a measurement."""
    path = Path(path)
    if path.exists() and path.is_dir():
        raise ValueError(f"{path} is a directory; pass a CSV file path such as {path / 'runs.csv'}")
    if path.suffix.lower() != ".csv":
        raise ValueError(f"results go to a .csv file, got {path}; pass e.g. --out results/runs.csv")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise not_writable(path, error, f"cannot create the folder {path.parent}") from None
    if path.is_file():
        advice = f"; pass another --out file name, or move {path} aside"
        if required == REQUIRED_COLUMNS:
            read_records(path, advice)  # every row: a damaged file is refused before any work, never rewritten
        else:
            check_header(path, csv_header(path), required, kind, advice=advice)
    target = path if path.exists() else path.parent
    if not os.access(target, os.W_OK) or not os.access(path.parent, os.W_OK):
        raise PermissionError(f"{path}: no write permission in {path.parent}; pass a writable --out path")
    try:  # what a write will do: take the lock, create a temporary file beside the CSV
        with _locked(path):
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            os.unlink(tmp)
    except OSError as error:
        raise not_writable(path, error, f"cannot create a file in {path.parent}") from None
    return path


def not_writable(path: Path, error: OSError, doing: str) -> OSError:
    """The error a failed write step raises, of the kind its cause is: PermissionError only when
    permission was refused (root is refused nothing, yet /proc takes no new files)."""
    why = error.strerror or str(error)
    message = f"{path}: {doing} ({why}); pass a writable --out path"
    return PermissionError(message) if error.errno in (errno.EACCES, errno.EPERM) else NotWritable(message)


def read_rows(path: str | Path) -> list[dict]:
    """Rows as dicts of strings, each as the current schema reads it (schema.upgrade), one per
    point: of rows that an upgrade makes one point (the same key), the one `preferred` takes. A file
    that is not a results CSV, is of a newer schema or is damaged raises ValueError (parse.py)."""
    path = Path(path)
    if not path.exists():
        return []
    return one_per_point(upgrade(row) for row in read_records(path))


def one_per_point(rows: Iterable[dict]) -> list[dict]:
    """One row per key, in the order the keys first appear: of several, the one `preferred` takes."""
    kept: dict[tuple[str, ...], dict] = {}
    for row in rows:
        key = row_key(row)
        kept[key] = preferred(kept[key], row) if key in kept else row
    return list(kept.values())


def preferred(a: dict, b: dict) -> dict:
    """Of two rows of one point, the one a reader takes: an ok row over one that failed, else the
    later (by timestamp; `b` on a tie)."""
    if (a.get("status") == "ok") != (b.get("status") == "ok"):
        return a if a.get("status") == "ok" else b
    return b if b.get("timestamp_utc", "") >= a.get("timestamp_utc", "") else a


# The start of an ok row's error once a rerun of its point failed: the row keeps its measurement.
FAILED_RERUN = "rerun failed"


def keeps_earlier(old: dict, new: dict) -> bool:
    """Whether `old` stays when `new` of the same point is upserted: a failed rerun (oom, error,
    timeout, skipped, unsupported) never replaces an ok measurement."""
    return old.get("status") == "ok" and new.get("status") != "ok"


def stored_row(old: dict | None, new: dict) -> dict:
    """The point's row once `new` is upserted over `old`: `new`, or where `old` stays, `old` with the
    failed attempt (when, which commit, its status and error) in its error column."""
    if old is None or not keeps_earlier(old, new):
        return new
    commit = (new.get("git_commit") or "unknown")[:7] + ("-dirty" if new.get("git_dirty") == "true" else "")
    when = new.get("timestamp_utc") or "an unknown time"
    attempt = f"{FAILED_RERUN} at {when} (commit {commit}): {new.get('status')}"
    if new.get("error"):
        attempt += f": {new['error']}"
    return {**old, "error": attempt[:500]}


def csv_header(path: Path) -> list[str]:
    """The header of a CSV ([] for a missing or empty file; a file that is not text has none that fits)."""
    if not path.exists():
        return []
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            return next(csv.reader(f), [])
    except UnicodeDecodeError:
        return ["(not text)"]


def lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold the CSV's lock file (flock), created if needed and removed on release. A waiter that
    got the lock of a file removed meanwhile (its inode no longer at the path) takes the new one;
    a file no process holds (left by a killed writer) is simply taken and removed."""
    lock = lock_path(path)
    while True:
        handle = lock.open("a")
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            if os.stat(lock).st_ino == os.fstat(handle.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        handle.close()
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)  # still held: a process waiting on this inode retries on a new file
        handle.close()


def _new_file_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _write_atomic(path: Path, columns: list[str], rows: list[dict]) -> None:
    mode = path.stat().st_mode & 0o777 if path.exists() else _new_file_mode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)  # mkstemp makes 0600
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
    """Add rows to the CSV; a row whose key is already there replaces it (replace=True; but a failed
    rerun never replaces an ok row: `stored_row`) or is dropped (replace=False). A file of a newer
    schema or a damaged one is never rewritten (read_rows refuses it). If the
    write fails (the file changed since check_writable, a full disk), the new rows go to a file
    beside it and RowsNotSaved names that file."""
    path = Path(path)
    new = [encode_row(r) for r in rows]
    try:
        check_writable(path)
        with _write_errors(path), _locked(path):
            existing = read_rows(path)
            index = {row_key(row): i for i, row in enumerate(existing)}
            for row in new:
                i = index.get(row_key(row))
                if i is None:
                    index[row_key(row)] = len(existing)
                    existing.append(row)
                elif replace:
                    existing[i] = stored_row(existing[i], row)
            _write_atomic(path, list(COLUMNS), existing)
    except (OSError, ValueError) as error:
        raise RowsNotSaved(
            f"{error}; the {len(new)} new row(s) are kept in {keep_unsaved(path, COLUMNS, new)}"
        ) from None


def keep_unsaved(path: Path, columns: Iterable[str], rows: list[dict]) -> Path:
    """Rows that could not be added to `path`, in a new CSV of their own beside it (or in the
    temporary folder when that folder takes no file): nothing measured is lost."""
    for folder in (path.parent, Path(tempfile.gettempdir())):
        name = None
        try:
            fd, name = tempfile.mkstemp(prefix=f"{path.stem}.unsaved-", suffix=".csv", dir=folder)
            with os.fdopen(fd, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
                writer.writeheader()
                writer.writerows(rows)
            return Path(name)
        except OSError:
            if name:
                Path(name).unlink(missing_ok=True)
    raise OSError(f"no folder takes a file for the rows meant for {path}")  # not even the temporary one


@contextmanager
def _write_errors(path: Path) -> Iterator[None]:
    """An OS error while writing names the CSV (not its lock or temporary file)."""
    try:
        yield
    except OSError as error:
        if str(path) in str(error):
            raise
        raise not_writable(path, error, "the write failed") from None


def completed_keys(path: str | Path) -> set[tuple[str, ...]]:
    """Keys of the points already in a results file (for resuming)."""
    return {row_key(row) for row in read_rows(path)}


def results_file(source: str | Path) -> Path:
    """The CSV an `sbp run --out` should write for `source` to be read: itself if it names a CSV,
    else a runs.csv inside it (a folder: every CSV under it is read)."""
    source = Path(source)
    return source if source.suffix.lower() == ".csv" else source / "runs.csv"


def _numeric(table):
    """Columns whose every non-empty value is a number become numeric (empty -> NaN)."""
    import pandas as pd

    for column in table.columns:
        values = table[column].replace("", None)
        converted = pd.to_numeric(values, errors="coerce")
        if converted.notna().sum() == values.notna().sum():
            table[column] = converted
    return table


def load_results(source: str | Path, kinds: tuple[str, ...] | None = None):
    """A results CSV, or every CSV under a directory, as one pandas DataFrame in schema column order;
    only the rows of `kinds` where given (e.g. RESULT_KINDS: no seed rows). A point in several files
    is one row, the one `preferred` takes (its file in source_file). A file read_rows refuses is an
    error; under a directory it is skipped with a warning naming it."""
    import pandas as pd

    source = Path(source)
    files = sorted(source.rglob("*.csv")) if source.is_dir() else [source]
    if not files or not all(f.exists() for f in files):
        raise FileNotFoundError(f"no results CSV at {source}; run `sbp run --out {results_file(source)}` first")
    rows = []
    for f in files:
        try:  # read_rows upgrades old rows
            rows += [{**row, "source_file": str(f)} for row in read_rows(f) if kinds is None or row["kind"] in kinds]
        except ValueError as error:
            if not source.is_dir():
                raise
            warnings.warn(f"{error}; skipped", ResultsFileWarning, stacklevel=2)  # another CSV in the folder
    table = pd.DataFrame(one_per_point(rows) if len(files) > 1 else rows).fillna("")
    table = _numeric(table)
    ordered = [c for c in COLUMNS if c in table.columns]
    return table[ordered + [c for c in table.columns if c not in ordered]]
