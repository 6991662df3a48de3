"""One table from exception to a one-line message. A traceback only with SBP_DEBUG=1."""

from __future__ import annotations

import os
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.markup import escape

from ..config import ConfigError
from ..models import UnsupportedModelError
from ..records import NotWritable, RowsNotSaved
from .options import FLAGS

_stderr = Console(stderr=True)

# exception type -> prefix shown before the exception's own message (which says what to do)
USER_ERRORS: dict[type[BaseException], str] = {
    RowsNotSaved: "results not saved",
    NotWritable: "cannot write",
    UnsupportedModelError: "unsupported model",
    ValueError: "invalid input",
    FileNotFoundError: "file not found",
    PermissionError: "permission denied",
    NotImplementedError: "not supported",
}


@contextmanager
def user_errors():
    """Turn a known exception into `error: <kind>: <message>` and exit code 2."""
    try:
        yield
    except tuple(USER_ERRORS) as error:
        if os.environ.get("SBP_DEBUG"):
            raise
        kind = next(v for k, v in USER_ERRORS.items() if isinstance(error, k))
        if isinstance(error, ConfigError):  # the user typed a flag, not a field name
            error = ValueError(error.naming(FLAGS.get(error.field, error.field)))
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        _stderr.print(f"[bold red]error[/]: {kind}: {escape(message)}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
