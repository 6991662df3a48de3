"""One table from exception to a one-line message. A traceback only with SBP_DEBUG=1."""

from __future__ import annotations

import os
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.markup import escape

from ..settings import ConfigError
from .flags import FLAGS
from .outcomes import USAGE

_stderr = Console(stderr=True)

# exception class name -> the prefix shown before the exception's own message (which says what
# to do); the first of an error's classes (its own, then its bases) found here. By name, so that
# this table imports nothing: sbpbench.core.UnsupportedModelError lives beside torch.
USER_ERRORS: dict[str, str] = {
    "RowsNotSaved": "results not saved",  # sbpbench.records
    "NotWritable": "cannot write",  # sbpbench.records
    "UnsupportedModelError": "unsupported model",
    "ValueError": "invalid input",
    "FileNotFoundError": "file not found",
    "PermissionError": "permission denied",
    "NotImplementedError": "not supported",
}


def error_kind(error: BaseException) -> str | None:
    """The prefix of a user's mistake; None for anything else (a bug: its traceback is shown)."""
    return next((USER_ERRORS[c.__name__] for c in type(error).__mro__ if c.__name__ in USER_ERRORS), None)


@contextmanager
def user_errors():
    """Turn a known exception into `error: <kind>: <message>` and exit code 2 (outcomes.USAGE)."""
    try:
        yield
    except Exception as error:
        kind = error_kind(error)
        if kind is None or os.environ.get("SBP_DEBUG"):
            raise
        if isinstance(error, ConfigError):  # the user typed a flag, not a field name
            error = ValueError(error.naming(FLAGS.get(error.field, error.field)))
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        _stderr.print(f"[bold red]error[/]: {kind}: {escape(message)}", highlight=False, soft_wrap=True)
        raise typer.Exit(USAGE) from None
