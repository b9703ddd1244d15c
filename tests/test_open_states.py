"""The state files a server keeps open (kite.serve.open_states): once per version, the least recently
asked closed first, a file at a new version opened again and its old one closed."""

from __future__ import annotations

from pathlib import Path

from kite.serve.open_states import OpenStates


class Opened:
    def __init__(self, name):
        self.name, self.closed = name, False

    def close(self):
        self.closed = True


def test_files_are_kept_by_version_and_the_least_recently_asked_closed_first():
    kept = OpenStates(size=2)
    a1 = kept.get(Path("/s/a.upc"), (1,), lambda: Opened("a1"))
    assert kept.get(Path("/s/a.upc"), (1,), lambda: Opened("again")) is a1
    b = kept.get(Path("/s/b.upc"), (1,), lambda: Opened("b"))
    kept.get(Path("/s/a.upc"), (1,), lambda: Opened("again"))          # a is now the most recent
    c = kept.get(Path("/s/c.upc"), (1,), lambda: Opened("c"))          # b goes
    assert b.closed and not a1.closed and not c.closed and len(kept) == 2
    a2 = kept.get(Path("/s/a.upc"), (2,), lambda: Opened("a2"))         # a replaced: opened again
    assert a2.name == "a2" and a1.closed
    assert (kept.opened, kept.reused) == (4, 2)
    kept.forget(Path("/s/c.upc"))
    assert c.closed and len(kept) == 1
    kept.forget(Path("/s/never.upc"))                                   # nothing kept: nothing to do
    kept.close()
    assert a2.closed and len(kept) == 0
