"""Progress of a long command: one line per finished unit (a point, a probe, a search), and on a
terminal a progress bar below them. When stdout is not a terminal (a log file, a pipe, CI) a bar
would print nothing until the end: each line then carries the elapsed time and the ETA.

The bar fits any width: the description takes what the counts and times leave (cut with "…"
when it must be; its line above is whole), the bar shrinks, the times never."""

from __future__ import annotations

import time
from typing import Self

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.table import Column

from ..measure.units import duration


class Progress:
    """`total` units (None: unknown); `advance` finishes one, `note` reports a step inside one (a
    probe of a search) without finishing it. The ETA is the mean time of a finished unit times
    the units left, shown once one has finished."""

    def __init__(self, console: Console, total: int | None):
        self.console, self.total, self.done = console, total, 0
        self.started = time.monotonic()
        self._bar = None
        if console.is_terminal:
            self._bar = RichProgress(
                TextColumn("{task.description}", table_column=Column(ratio=3, no_wrap=True, overflow="ellipsis")),
                BarColumn(bar_width=None, table_column=Column(ratio=1, min_width=5)),
                MofNCompleteColumn(),
                TextColumn("elapsed"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
                transient=False,
                expand=True,  # the ratios above share the width the fixed columns leave
            )
            self._task = self._bar.add_task("starting", total=total)

    def __enter__(self) -> Self:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def eta_s(self) -> float | None:
        if not self.done or self.total is None or self.done >= self.total:
            return None
        return self.elapsed_s() / self.done * (self.total - self.done)

    def start(self, description: str) -> None:
        """The unit now running (shown on the bar; a log gets a line only when it finishes)."""
        if self._bar is not None:
            self._bar.update(self._task, description=escape(description))

    def note(self, line: str) -> None:
        """A step inside the running unit finished (e.g. one probe of a search)."""
        if self._bar is not None:
            self._print(f"  {line}")
            self._bar.update(self._task, description=escape(line))
        else:
            self._print(f"  {line} ({duration(self.elapsed_s())} elapsed)")

    def advance(self, line: str) -> None:
        """One unit finished; `line` says how it ended."""
        self.done += 1
        count = f"[{self.done}/{self.total}]" if self.total is not None else f"[{self.done}]"
        if self._bar is not None:  # the bar shows the times
            self._print(f"{count} {line}")
            self._bar.update(self._task, advance=1, description=escape(line))
            return
        eta = self.eta_s()
        timing = f"{duration(self.elapsed_s())} elapsed" + ("" if eta is None else f", ETA {duration(eta)}")
        self._print(f"{count} {line} ({timing})")

    def _print(self, text: str) -> None:
        self.console.print(escape(text), highlight=False, soft_wrap=True)
