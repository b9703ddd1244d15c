"""A rich progress bar on stderr for long work; silent when stderr is not a terminal."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kite.cli._common import err_console


@contextlib.contextmanager
def progress_bar() -> Iterator:
    """Yields a callback `(stage, done, total)`; one bar per stage."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = err_console()
    bars: dict[str, int] = {}
    with Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as prog:
        def update(stage: str, done: int, total: int) -> None:
            if stage not in bars:
                bars[stage] = prog.add_task(stage, total=total)
            prog.update(bars[stage], completed=done, total=total)

        yield update
