"""Reading a results CSV strictly: every row, or a one-line refusal naming the file, line and column.

A results file is the only copy of its measurements, and each write rewrites it whole. A row read
wrongly would be rewritten wrongly, or dropped. So a damaged file is refused (ValueError) before any
work and never rewritten; the message says where to repair it. Damage it finds:
  - bytes that are not UTF-8 text, or NUL bytes (a binary file, a PNG);
  - a header line inside the body (two files joined with `cat`);
  - a row with fewer fields than the header, or no line end at the end of the file (a copy cut short);
  - a row with more fields than the header;
  - a required value missing, a number or a bool that does not parse, a status, kind, source or
    sp_layout the schema does not know, a rank count under 1, an sp that does not divide nproc.
A UTF-8 byte-order mark (a spreadsheet's export) is read past.
"""

from __future__ import annotations

import codecs
import csv
import io
import math
from dataclasses import fields
from pathlib import Path

from ..settings.choices import SP_LAYOUTS
from .schema import COLUMNS, KINDS, REQUIRED_COLUMNS, SCHEMA_VERSION, SOURCES, STATUSES, ResultRow

# a column's kind, from its field's type ("int | None" -> int); text columns are not checked
KIND_OF: dict[str, str] = {f.name: str(f.type).split(" ")[0] for f in fields(ResultRow)}
CHOICES: dict[str, tuple[str, ...]] = {"status": STATUSES, "kind": KINDS, "source": SOURCES, "sp_layout": SP_LAYOUTS}
COUNTS = ("nproc", "sp")  # ranks: at least 1 where given
REPAIR = "fix or remove that line"


def read_text(path: Path, advice: str = "") -> str:
    """The file's text, a byte-order mark dropped; ValueError naming the file if it is not text."""
    data = path.read_bytes()
    body = data.removeprefix(codecs.BOM_UTF8)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        offset = error.start + len(data) - len(body)
        why = f"byte 0x{data[offset]:02x} at offset {offset} is not UTF-8 text"
        raise ValueError(f"{path} is not a results CSV: {why}{advice}") from None
    if "\0" in text:
        raise ValueError(f"{path} is not a results CSV: it holds NUL bytes (binary data){advice}")
    return text


NEWER = "written by a newer sbpbench; upgrade sbpbench (pip install -U) to read it, or move the file aside"


def read_records(path: Path, advice: str = "") -> list[dict[str, str]]:
    """A results CSV's rows as dicts of strings, as written ([] for an empty file); ValueError naming
    the file when it is not a results CSV (`advice` added: what to do instead), is of a newer schema,
    or is damaged (and where)."""
    text = read_text(path, advice)
    if not text.strip():
        return []
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, [])
    except csv.Error as error:
        raise ValueError(f"{path} line 1: not CSV ({error})") from None
    check_header(path, header or ["(no header)"], advice=advice)
    check_known_columns(path, header)
    rows = parse_rows(path, reader, header)
    if rows and not text.endswith(("\n", "\r")):
        raise ValueError(f"{path} line {reader.line_num} has no line end: cut short in column {header[-1]}; {REPAIR}")
    return rows


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


def check_known_columns(path: Path, header: list[str]) -> None:
    """ValueError naming the file when its header has a column this schema does not know."""
    unknown = [c for c in header if c not in COLUMNS]
    if unknown:
        raise ValueError(
            f"{path} has column(s) {', '.join(unknown)[:80]} that results schema {SCHEMA_VERSION} does not know: {NEWER}"
        )


def parse_rows(path: Path, reader, header: list[str]) -> list[dict[str, str]]:
    """The rows a csv.reader gives after `header`; ValueError at the first damaged one, naming the
    file, its line and the column. A row of a newer schema is refused as such before its values are
    checked (a newer schema may have values this one does not know)."""
    rows, start = [], reader.line_num + 1
    try:
        for cells in reader:
            line, start = start, reader.line_num + 1
            if not cells:
                continue  # a blank line
            _check_cells(path, line, header, cells)
            record = dict(zip(header, cells))
            newer_row(path, line, record)
            for column, value in record.items():
                if why := bad_value(column, value):
                    raise ValueError(f"{path} line {line}, column {column}: {why}; {REPAIR}")
            if why := bad_ranks(record):
                raise ValueError(f"{path} line {line}, column sp: {why}; {REPAIR}")
            rows.append(record)
    except csv.Error as error:
        raise ValueError(f"{path} line {start}: not CSV ({error}); {REPAIR}") from None
    return rows


def newer_row(path: Path, line: int, record: dict) -> None:
    version = record.get("schema_version") or ""
    if version.isdigit() and int(version) > SCHEMA_VERSION:
        raise ValueError(f"{path} line {line} is of results schema {version}, newer than {SCHEMA_VERSION}: {NEWER}")


def _check_cells(path: Path, line: int, header: list[str], cells: list[str]) -> None:
    """A row whose cells are the header's names, or whose count is not the header's."""
    if set(REQUIRED_COLUMNS) <= set(cells):
        raise ValueError(f"{path}: header repeated at line {line} (two files joined?); remove that line")
    if len(cells) < len(header):
        column = header[max(len(cells) - 1, 0)]
        raise ValueError(
            f"{path} line {line} is cut short in column {column} ({len(cells)} of {len(header)} fields); {REPAIR}"
        )
    if len(cells) > len(header):
        raise ValueError(f"{path} line {line} has {len(cells)} fields, the header {len(header)}; {REPAIR}")


def bad_value(column: str, text: str) -> str | None:
    """Why a cell cannot be its column's value, or None: a required one empty, a number, a bool or a
    choice that does not parse."""
    if not text:
        return "empty, but every row needs it" if column in REQUIRED_COLUMNS else None
    if column not in COLUMNS:
        return None
    kind = KIND_OF[column]
    if kind == "int" and not _is_whole(text):
        return f"{text[:40]!r} is not a whole number"
    if kind == "float" and not _is_number(text):
        return f"{text[:40]!r} is not a number"
    if kind == "bool" and text not in ("true", "false"):
        return f"{text[:40]!r} is not true or false"
    if column in CHOICES and text not in CHOICES[column]:
        return f"{text[:40]!r} is not one of {', '.join(CHOICES[column])}"
    if column in COUNTS and float(text) < 1:
        return f"{text[:40]!r} ranks: it is at least 1"
    return None


def bad_ranks(record: dict[str, str]) -> str | None:
    """Why a row's sp cannot share its nproc ranks (the ranks sharing a sequence divide them), or None."""
    sp, nproc = record.get("sp"), record.get("nproc")
    if not sp or not nproc or int(float(nproc)) % int(float(sp)) == 0:
        return None
    return f"{sp} ranks per sequence do not divide nproc {nproc}"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_whole(text: str) -> bool:
    """An integer as written ("8192"), or as a float of one ("8192.0": a spreadsheet's)."""
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and value.is_integer()
