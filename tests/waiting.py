"""Waiting in tests for a condition, not for a length of time."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float = 10.0, interval_s: float = 0.01,
               what: str = "the condition") -> T:
    """Call ``predicate`` every ``interval_s`` until it returns something truthy, and return that.
    After ``timeout_s`` without it, fail the test naming ``what`` was awaited and the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}; last seen: {value!r}")
        time.sleep(interval_s)
