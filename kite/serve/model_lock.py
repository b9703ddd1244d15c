"""The server's model lock: re-entrant, and taken in the order it was asked for.

The batch's scheduler takes the lock for every step and asks for it again at once. A plain
`threading.RLock` lets the thread that released it win it back before a waiter wakes, so a request
thread waiting to run YOCO's decision (or the measured gain after its answer) could sit out many
steps: new requests joined the batch late and finished answers were held back from their clients.
Here a release hands the lock to the longest waiter, so a waiter runs at the next step boundary.
"""

from __future__ import annotations

import threading
from collections import deque


class ModelLock:
    """A first-come-first-served re-entrant lock (the `with` form of `threading.RLock`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._waiting: deque[int] = deque()   # thread ids in arrival order

    def acquire(self) -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None and not self._waiting:
                self._owner, self._depth = me, 1
                return True
            self._waiting.append(me)
            while self._owner is not None or self._waiting[0] != me:
                self._cond.wait()
            self._waiting.popleft()
            self._owner, self._depth = me, 1
            return True

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("the model lock is released by a thread that does not hold it")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                if self._waiting:
                    self._cond.notify_all()

    @property
    def waiting(self) -> int:
        """Threads waiting for the lock now."""
        with self._cond:
            return len(self._waiting)

    def __enter__(self) -> "ModelLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
