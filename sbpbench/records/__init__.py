"""The results schema and the CSV files that hold it."""

from .schema import COLUMNS, KEY_COLUMNS, PROVENANCE_COLUMNS, SCHEMA_VERSION, STATUSES, ResultRow
from .store import check_writable, completed_keys, load_results, read_rows, row_key, upsert_rows

__all__ = [
    "COLUMNS",
    "KEY_COLUMNS",
    "PROVENANCE_COLUMNS",
    "SCHEMA_VERSION",
    "STATUSES",
    "ResultRow",
    "check_writable",
    "completed_keys",
    "load_results",
    "read_rows",
    "row_key",
    "upsert_rows",
]
