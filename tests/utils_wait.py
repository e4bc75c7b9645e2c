"""Waiting for a state in tests: poll until it holds, with a generous safety-net bound that
only stops a hung test (the caller asserts the state, never the time it took)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    predicate: Callable[[], bool], timeout_s: float = 60.0, interval_s: float = 0.05
) -> bool:
    """Polls `predicate` until it is true or `timeout_s` passed; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
