"""Two thread pools for grammar compiles, chosen by the constraint's size."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.limits import SMALL_CONSTRAINT_LENGTH, constraint_length

T = TypeVar("T")


class CompileLanes:
    """Runs compiles on two lanes of `num_workers` threads each: constraints up to
    SMALL_CONSTRAINT_LENGTH characters on one, bigger ones on the other, so that a choice or a
    short regex never waits behind big schemas. Threads start on the first submit.
    Thread-safe.
    """

    def __init__(self, num_workers: int) -> None:
        self._num_workers = num_workers
        self._lock = threading.Lock()
        self._small: ThreadPoolExecutor | None = None
        self._big: ThreadPoolExecutor | None = None
        self._closed = False

    def lane(self, params: StructuredOutputsParams) -> ThreadPoolExecutor:
        """The lane for `params`, created on first use. RuntimeError after shutdown."""
        small = constraint_length(params, cap=SMALL_CONSTRAINT_LENGTH) <= SMALL_CONSTRAINT_LENGTH
        with self._lock:
            if self._closed:
                raise RuntimeError("structured outputs: compile lanes used after shutdown")
            if self._small is None or self._big is None:
                self._small = ThreadPoolExecutor(self._num_workers, "grammar-small")
                self._big = ThreadPoolExecutor(self._num_workers, "grammar-big")
            return self._small if small else self._big

    def submit(
        self, params: StructuredOutputsParams, fn: Callable[..., T], *args: Any
    ) -> Future[T]:
        """Runs `fn(*args)` on the lane for `params`. RuntimeError after shutdown."""
        return self.lane(params).submit(fn, *args)

    def shutdown(self) -> None:
        """Cancels queued compiles and stops taking new ones (running ones finish in the
        background). Idempotent."""
        with self._lock:
            self._closed = True
            lanes, self._small, self._big = (self._small, self._big), None, None
        for lane in lanes:
            if lane is not None:
                lane.shutdown(wait=False, cancel_futures=True)
