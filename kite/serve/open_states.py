"""The state files a server has open, by path and file version, for the next question about them.

Every request about a state needs its header (YOCO's decision reads its clusters; the prefix cache
keys its load on the file's version). A 16K-token state of a 7B model has ~450 parts, a header of
tens of KB, parsed once per request and, in a burst, one after another on the model's thread before
any of the burst joins the batch. Here a state's file is opened once per version (the version its path has now:
``kite.upcycle.format.versions.path_version``) and kept open; a file replaced under its path is
opened again, a file gone is forgotten. At most ``size`` files are open; the least recently asked
is closed first. Only the model's thread uses it (the loaders read by ``os.pread``, so sharing an
open file between requests is safe).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Callable

OPEN_STATES = 64     # files a server keeps open


class OpenStates:
    def __init__(self, size: int = OPEN_STATES):
        self.size = size
        self._open: OrderedDict[str, tuple[tuple, object]] = OrderedDict()
        self.opened = self.reused = 0

    def get(self, path: Path, version: tuple, opener: Callable[[], object]):
        """The open state at ``path`` whose file is at ``version``: the one kept, or ``opener()``'s
        (kept from then on; a file kept at another version is closed)."""
        key = str(path)
        kept = self._open.get(key)
        if kept is not None and kept[0] == version:
            self._open.move_to_end(key)
            self.reused += 1
            return kept[1]
        self.forget(path)
        state = opener()
        self.opened += 1
        self._open[key] = (version, state)
        while len(self._open) > self.size:
            _, (_, old) = self._open.popitem(last=False)
            old.close()
        return state

    def forget(self, path: Path) -> None:
        """Close the file kept for ``path`` (its state was deleted, replaced or refused), if any."""
        kept = self._open.pop(str(path), None)
        if kept is not None:
            kept[1].close()

    def close(self) -> None:
        for _, state in self._open.values():
            state.close()
        self._open.clear()

    def __len__(self) -> int:
        return len(self._open)
