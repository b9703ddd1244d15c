"""States a reader refused, quarantined until their file changes.

A completion that names a state opens and loads it on the model's thread. When a reader check
refuses the state's bytes there (BadInput while opening the file or loading its parts: a corrupt or
crafted `.upc`, docs/upc-format.md "What a reader detects"), the request fails alone with
:class:`StateUnusable` (HTTP 422) naming the state, and the state is quarantined under the file's
version (:func:`kite.upcycle.path_version`). While that version stays on disk, a request naming the
state is refused at once with :class:`StateQuarantined` (422), before the model's thread and without
reading the file. A new version (an upload with overwrite, a replacement on disk) lifts the
quarantine, as do a delete and ``DELETE /admin/states/{id}/quarantine``.

Only reader refusals quarantine: a state made by another model (FingerprintMismatch, 409) or a
failure that is not the state's (an out-of-memory error, a bug: 500) is reported and tried again
next time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kite.errors import BadInput

_log = logging.getLogger("kite.serve")

REFUSED_CAUSES = ("unreadable", "quarantined")   # a load a reader refused; a request refused without one


class StateUnusable(BadInput):
    """A state a reader refused: its file is corrupt or crafted (HTTP 422)."""


class StateQuarantined(StateUnusable):
    """A state quarantined after a reader refused it; refused without a read (HTTP 422)."""


@dataclass(frozen=True, slots=True)
class QuarantineEntry:
    state_id: str
    version: tuple      # the file's version a reader refused (kite.upcycle.path_version)
    reason: str         # the reader's one line, without the server's paths
    since: float        # unix time

    def current(self) -> bool:
        """Whether the file on disk is still the version that was refused."""
        from kite.upcycle import path_version

        try:
            return path_version(self.version[0]) == self.version
        except OSError:
            return False   # gone

    def to_dict(self, refused: int = 0) -> dict:
        return {"reason": self.reason, "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since)),
                "refused": refused}


class Quarantine:
    """The quarantined states of one server, by id; counts of the loads refused (thread-safe)."""

    def __init__(self) -> None:
        self._entries: dict[str, QuarantineEntry] = {}
        self._refusals: dict[str, int] = {}   # id -> requests refused since it was quarantined
        self._lock = threading.Lock()
        self.refused = dict.fromkeys(REFUSED_CAUSES, 0)

    def entry(self, state_id: str) -> QuarantineEntry | None:
        """The state's quarantine while its refused version is on disk; one whose file changed or
        went is lifted here."""
        with self._lock:
            hit = self._entries.get(state_id)
        if hit is None:
            return None
        if hit.current():
            return hit
        self._drop(state_id, hit, "its file changed")
        return None

    def check(self, state_id: str) -> None:
        """StateQuarantined when the state is quarantined (counted as a refused load)."""
        hit = self.entry(state_id)
        if hit is None:
            return
        with self._lock:
            self.refused["quarantined"] += 1
            self._refusals[state_id] = self._refusals.get(state_id, 0) + 1
        raise StateQuarantined(f"state {state_id!r} is quarantined: {hit.reason} (since {hit.to_dict()['since']}, "
                               f"until its file is replaced)")

    @contextlib.contextmanager
    def reading(self, state_id: str, path: Path, version: tuple):
        """Around a read of the state's file at ``path`` (version ``version``, taken before the read):
        a BadInput raised inside quarantines the state and leaves as StateUnusable naming it."""
        try:
            yield
        except StateUnusable:
            raise
        except BadInput as exc:
            reason = _reason(exc, path)
            self.put(state_id, version, reason)
            raise StateUnusable(f"state {state_id!r} does not load: {reason}; it is quarantined until its "
                                f"file is replaced") from exc

    def put(self, state_id: str, version: tuple, reason: str) -> QuarantineEntry:
        hit = QuarantineEntry(state_id, version, reason, time.time())
        with self._lock:
            self._entries[state_id] = hit
            self._refusals[state_id] = 0
            self.refused["unreadable"] += 1
        _log.warning("state %s quarantined: %s", state_id, reason)
        return hit

    def lift(self, state_id: str, why: str) -> bool:
        """End the state's quarantine (False: it was not quarantined)."""
        with self._lock:
            hit = self._entries.get(state_id)
        return hit is not None and self._drop(state_id, hit, why)

    def _drop(self, state_id: str, hit: QuarantineEntry, why: str) -> bool:
        with self._lock:
            if self._entries.get(state_id) is not hit:
                return False   # lifted or quarantined again meanwhile
            del self._entries[state_id]
            self._refusals.pop(state_id, None)
        _log.info("state %s out of quarantine: %s", state_id, why)
        return True

    def describe(self, state_id: str) -> dict | None:
        """What `/v1/states` shows of the state's quarantine (None: not quarantined)."""
        hit = self.entry(state_id)
        if hit is None:
            return None
        with self._lock:
            return hit.to_dict(self._refusals.get(state_id, 0))

    def ids(self) -> list[str]:
        """The states quarantined now (lifting those whose files changed)."""
        with self._lock:
            ids = list(self._entries)
        return [sid for sid in ids if self.entry(sid) is not None]

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.refused)


def _reason(exc: BaseException, path: Path) -> str:
    """The reader's first line without the server's own paths (its folders stay its own)."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    for p in dict.fromkeys((str(path), str(Path(path).resolve()))):
        line = line.removeprefix(f"{p}: ").replace(p, Path(p).name)
    return line
