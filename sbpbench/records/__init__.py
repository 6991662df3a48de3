"""The results schema, the CSV files that hold it, and reading their rows (select.py: OOM, capacity,
comparability with the paper), shared by the plots, the report and the CLI."""

from .schema import COLUMNS, KEY_COLUMNS, KINDS, PROVENANCE_COLUMNS, SCHEMA_VERSION, SOURCES, STATUSES, ResultRow
from .store import (
    NotWritable,
    RowsNotSaved,
    check_writable,
    completed_keys,
    decode_row,
    keeps_earlier,
    load_results,
    not_writable,
    one_line,
    read_rows,
    results_file,
    row_key,
    upsert_rows,
)

__all__ = [
    "COLUMNS",
    "KEY_COLUMNS",
    "KINDS",
    "PROVENANCE_COLUMNS",
    "SCHEMA_VERSION",
    "SOURCES",
    "STATUSES",
    "NotWritable",
    "ResultRow",
    "RowsNotSaved",
    "check_writable",
    "completed_keys",
    "decode_row",
    "keeps_earlier",
    "load_results",
    "not_writable",
    "one_line",
    "read_rows",
    "results_file",
    "row_key",
    "upsert_rows",
]
