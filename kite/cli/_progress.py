"""Progress of long work, on stderr (never in `--json` stdout): a rich bar on a terminal; off one
(a CI log, a file, a pipe) a plain line per step, at most every few seconds, as pip and cargo do.

A stage may carry a live detail after " · " (`"train · loss 0.41 · 52 tok/s"`): the bar and the
line are the stage's (the part before it), the text shown is the whole."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator

from kite.cli._common import err_console

Progress = Callable[[str, int, int], None]

# Off a terminal, a stage's steps between its first and its last print at most this often (s).
PLAIN_INTERVAL_S = 5.0
# ... and a step that runs longer than this without a line (a tagger fit, a model load) has its
# line repeated, marked `(running)`, so a log (and a CI watchdog) sees the command is alive (s).
QUIET_S = 30.0


class PlainProgress:
    """`(stage, done, total)` → `[  41.2s] cases 3/12` lines on stderr (elapsed since the start).

    A stage's first line and its last (done == total) always print; the steps between, at most
    every `interval_s` per stage; the same (stage, done, total) twice in a row prints once.
    `beat()` repeats the latest unfinished step, marked `(running)`, after `quiet_s` without a line."""

    def __init__(self, interval_s: float = PLAIN_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 quiet_s: float = QUIET_S):
        self.interval_s, self.quiet_s = interval_s, quiet_s
        self.clock = clock
        self.start = self.printed_at = clock()
        self.last_at: dict[str, float] = {}
        self.last_line: tuple[str, int, int] | None = None
        self.running: tuple[str, int, int] | None = None   # the latest step, while its stage is unfinished
        self._lock = threading.Lock()   # beat() runs on a timer thread

    def __call__(self, stage: str, done: int, total: int) -> None:
        with self._lock:
            now = self.clock()
            name = stage.partition(" · ")[0]
            key = (stage, done, total)
            self.running = key if done < total else None
            due = (name not in self.last_at or done >= total
                   or now - self.last_at[name] >= self.interval_s)
            if not due or key == self.last_line:
                return
            self.last_at[name], self.last_line = now, key
            self._write(now, f"{stage} {done}/{total}")

    def beat(self) -> None:
        with self._lock:
            now = self.clock()
            if self.running is not None and now - self.printed_at >= self.quiet_s:
                stage, done, total = self.running
                self._write(now, f"{stage} {done}/{total} (running)")

    def _write(self, now: float, text: str) -> None:
        self.printed_at = now
        stream = sys.stderr  # looked up per line: the one in force now (tests swap it)
        stream.write(f"[{now - self.start:7.1f}s] {text}\n")
        stream.flush()


@contextlib.contextmanager
def _beating(progress: PlainProgress) -> Iterator[None]:
    """A daemon thread calls `progress.beat()` every few seconds until the block ends."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(min(5.0, progress.quiet_s)):
            progress.beat()

    thread = threading.Thread(target=loop, name="kite-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def progress_bar() -> Iterator[Progress]:
    """Yields a callback `(stage, done, total)`: one rich bar per stage on a terminal, else
    `PlainProgress` lines."""
    console = err_console()
    if not console.is_terminal:
        plain = PlainProgress()
        with _beating(plain):
            yield plain
        return
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as RichProgress

    bars: dict[str, int] = {}
    with RichProgress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as prog:
        def update(stage: str, done: int, total: int) -> None:
            name = stage.partition(" · ")[0]
            if name not in bars:
                bars[name] = prog.add_task(stage, total=total)
            prog.update(bars[name], completed=done, total=total, description=stage)

        yield update


def say(message: str) -> None:
    """A one-off progress message (a GGUF file being converted) on stderr, as the lines above."""
    err_console().print(message, style="dim", highlight=False, markup=False, soft_wrap=True)


@contextlib.contextmanager
def step(progress: Progress | None, stage: str) -> Iterator[None]:
    """One step of work without steps of its own: `stage 0/1` before, `stage 1/1` after."""
    if progress:
        progress(stage, 0, 1)
    yield
    if progress:
        progress(stage, 1, 1)
