"""Results CSV files: atomic upsert by key, reading back, loading into pandas.

A write never edits the file in place: the whole table goes to a temporary file in the same
directory, is fsynced, and replaces the old one with os.replace (atomic on POSIX), with the mode
the umask gives a new file (an existing file keeps its own). A process killed at any moment
leaves either the old table or the new one, never a torn row. A lock file beside the CSV
serialises concurrent writers (read-modify-write would otherwise lose rows); its holder removes
it, and one left by a killed process is stale (no process holds its flock) and removed by the
next writer. Raw fcntl, not the `filelock` package: its FileLock keeps the lock file after release
(to keep waiters on one inode); here a waiter re-checks the inode instead, so no file is left.

Reading checks every row against the schema: a file whose header lacks REQUIRED_COLUMNS is not
a results CSV (ValueError); a file with a column this schema does not know, or a row of a newer
schema_version, was written by a newer sbpbench and is refused (ValueError naming it: read with an
older schema its rows would be misread, and rewritten they would lose what they say); a row cut
short or missing a required value is skipped with a warning (ResultsFileWarning) that names its line. check_writable checks the same header before
any work, and a write that fails all the same keeps its new rows in a file beside (RowsNotSaved).
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

from .schema import COLUMNS, KEY_COLUMNS, REQUIRED_COLUMNS, SCHEMA_VERSION, ResultRow, upgrade


class ResultsFileWarning(UserWarning):
    """A results CSV row that could not be read and was skipped."""


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
    a folder that cannot be created or written, or an existing file whose header is not a `kind`
    (lacks `required`): rows upserted into it would be lost at the end of a measurement."""
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
        check_header(path, csv_header(path), required, kind, advice=advice)
        if required == REQUIRED_COLUMNS:
            check_known_columns(path, csv_header(path))
            check_versions(path)
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


def check_header(
    path: Path,
    header: list[str],
    required: tuple[str, ...] = REQUIRED_COLUMNS,
    kind: str = "results CSV",
    advice: str = "",
) -> None:
    """ValueError unless a header has the `required` columns of a `kind` ([]: an empty file, which any write may fill)."""
    missing = [c for c in required if c not in header]
    if header and missing:
        shown = ",".join(header[:4])[:60]
        raise ValueError(
            f"{path} is not a {kind}: its first line ({shown!r}...) lacks the column(s) {', '.join(missing)}{advice}"
        )


NEWER = "written by a newer sbpbench; upgrade sbpbench (pip install -U) to read it, or move the file aside"


def check_known_columns(path: Path, header: list[str]) -> None:
    """ValueError naming the file when its header has a column this schema does not know."""
    unknown = [c for c in header if c not in COLUMNS]
    if unknown:
        raise ValueError(
            f"{path} has column(s) {', '.join(unknown)[:80]} that results schema {SCHEMA_VERSION} does not know: {NEWER}"
        )


def check_versions(path: Path) -> None:
    """ValueError naming the file and line of the first row of a newer schema_version than this one."""
    with path.open(newline="") as f:
        for line, record in enumerate(csv.DictReader(f), start=2):
            newer_row(path, line, record)


def newer_row(path: Path, line: int, record: dict) -> None:
    version = record.get("schema_version") or ""
    if version.isdigit() and int(version) > SCHEMA_VERSION:
        raise ValueError(f"{path} line {line} is of results schema {version}, newer than {SCHEMA_VERSION}: {NEWER}")


def read_rows(path: str | Path) -> list[dict]:
    """Rows as dicts of strings, each as the current schema reads it (schema.upgrade). Rows that
    an upgrade makes one point (the same key) are one row: the latest by timestamp. A row cut
    short or missing a required value is skipped with a ResultsFileWarning naming its line; a
    file that is not a results CSV, or is of a newer schema, raises ValueError."""
    path = Path(path)
    if not path.exists():
        return []
    rows = [upgrade(row) for row in _checked_rows(path)]
    latest: dict[tuple[str, ...], int] = {}
    for i, row in enumerate(rows):
        j = latest.setdefault(row_key(row), i)
        if j != i and row.get("timestamp_utc", "") >= rows[j].get("timestamp_utc", ""):
            latest[row_key(row)] = i
    kept = set(latest.values())
    return [row for i, row in enumerate(rows) if i in kept]


def _checked_rows(path: Path) -> list[dict]:
    """The rows of a results CSV that have every field of the header and the required values."""
    with path.open(newline="") as f:
        text = f.read()
    if not text.strip():
        return []
    reader = csv.DictReader(text.splitlines(keepends=True))
    header = reader.fieldnames or []
    check_header(path, header or ["(no header)"])
    check_known_columns(path, header)
    rows, start = [], 2
    for record in reader:
        line, start = start, reader.line_num + 1
        if None in record.values():
            _skip(path, line, f"has fewer fields than the header's {len(header)}: cut short")
        elif None in record:
            _skip(path, line, f"has more fields than the header's {len(header)}: damaged")
        elif missing := [c for c in REQUIRED_COLUMNS if not record[c]]:
            _skip(path, line, f"lacks the required field(s) {', '.join(missing)}")
        elif reader.line_num == text.count("\n") + 1 and not text.endswith(("\n", "\r")):
            _skip(path, line, "has no line end: cut short")
        else:
            newer_row(path, line, record)
            rows.append({k: v or "" for k, v in record.items()})
    return rows


def _skip(path: Path, line: int, why: str) -> None:
    warnings.warn(f"{path} line {line} {why}; row skipped", ResultsFileWarning, stacklevel=4)


def csv_header(path: Path) -> list[str]:
    """The header of a CSV ([] for a missing or empty file; a file that is not text has none that fits)."""
    if not path.exists():
        return []
    try:
        with path.open(newline="") as f:
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
    """Add rows to the CSV; a row whose key is already there replaces it (replace=True) or is
    dropped (replace=False). A file of a newer schema is never rewritten (read_rows refuses it). If the
    write fails (the file changed since check_writable, a full disk), the new rows go to a file
    beside it and RowsNotSaved names that file."""
    path = Path(path)
    new = [encode_row(r) for r in rows]
    try:
        check_writable(path)
        with _write_errors(path), _locked(path):
            existing = read_rows(path)
            columns = list(COLUMNS)
            index = {row_key(row): i for i, row in enumerate(existing)}
            for row in new:
                i = index.get(row_key(row))
                if i is None:
                    index[row_key(row)] = len(existing)
                    existing.append(row)
                elif replace:
                    existing[i] = row
            _write_atomic(path, columns, existing)
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
    only the rows of `kinds` where given (e.g. RESULT_KINDS: no seed rows)."""
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
    table = pd.DataFrame(rows).fillna("")
    table = _numeric(table)
    ordered = [c for c in COLUMNS if c in table.columns]
    return table[ordered + [c for c in table.columns if c not in ordered]]
