"""How a command ends: the exit codes, and the one line that says how its work stopped.

    0    done (an OOM is a result, not a failure)
    1    a failure: a point that errored or timed out, a failed probe, a check that found a difference
    2    a usage error: bad input, said in one line before any work (errors.py)
    3    the --budget ran out: what finished is kept, and the same command resumes
    130  interrupted (Ctrl-C): what finished is kept

A runner's Outcome (runner/outcome.py) becomes text and a code here; the commands print their
tables first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from ..runner.outcome import Outcome

OK, FAILED, USAGE, BUDGET_SPENT, INTERRUPTED = 0, 1, 2, 3, 130


def exit_code(outcome: Outcome) -> int:
    """Interrupted over failed over the budget: the most urgent of how the work stopped."""
    if outcome.interrupted:
        return INTERRUPTED
    if outcome.failed or outcome.errors:
        return FAILED
    return BUDGET_SPENT if outcome.stopped else OK


def finish(console: Console, outcome: Outcome) -> None:
    """Say how the work stopped, if it did, and exit with its code (return on 0)."""
    if outcome.failed:
        console.print(f"[red]{escape(outcome.failed)}[/]", highlight=False, soft_wrap=True)
    if outcome.stopped:
        console.print(outcome.stopped, style="yellow", highlight=False, soft_wrap=True)
    if outcome.interrupted:
        console.print(outcome.interrupted, highlight=False, soft_wrap=True)
    end(exit_code(outcome))


def end(code: int) -> None:
    """Exit with `code` unless it is OK."""
    if code != OK:
        raise typer.Exit(code)


def fail_if(failed: bool) -> None:
    """Exit FAILED when `failed`: the command has already said what."""
    end(FAILED if failed else OK)


def interrupted(console: Console, line: str) -> NoReturn:
    """Ctrl-C: say what was kept, exit INTERRUPTED."""
    console.print(line, highlight=False, soft_wrap=True)
    raise typer.Exit(INTERRUPTED)
