"""One request's constraint: its compile job, then its grammar."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

from vllm.exceptions import GrammarCompileError, InvalidRequestError
from vllm.reasoning import ReasoningParser, ReasoningState
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.backends.base import StructuredOutputGrammar
from vllm.v1.structured_output.compile_pool import CompileAbortedError


class StructuredOutputRequest:
    """Tracks the compilation of one request's constraint and holds the resulting grammar.

    The manager submits the compile job (`future`); the scheduler calls `poll` until the
    grammar is ready or the request has failed (`error` says why). With a reasoning parser
    the constraint applies only to the answer after the thinking (`advance_reasoning`).
    """

    def __init__(self, params: StructuredOutputsParams) -> None:
        self.params = params
        self.grammar: StructuredOutputGrammar | None = None
        # Why the request cannot run (compile error or timeout); None while all is well.
        self.exception: GrammarCompileError | None = None
        self.future: Future[StructuredOutputGrammar] | None = None
        # time.monotonic() when a worker began compiling: time spent queued behind other
        # compiles, or while backends are built (`pause`), does not count against the timeout.
        self.compile_started_at: float | None = None
        # True when `error` is a timeout (which depends on the load, not only the constraint).
        self.timed_out = False
        self._started = threading.Event()
        # Compile seconds counted before a `pause`.
        self._compiled_s = 0.0
        # Set by the manager's grammar_init when the server has a --reasoning-parser.
        self.reasoning_parser: ReasoningParser | None = None
        self.reasoning = ReasoningState.ENDED

    @property
    def thinking(self) -> bool:
        """True while the reply is inside its thinking block: its next token is free."""
        return self.reasoning == ReasoningState.THINKING

    @property
    def undecided(self) -> bool:
        """True before the first token of a reply that may open a thinking block: its next
        token is the grammar's or `<think>`."""
        return self.reasoning == ReasoningState.UNDECIDED

    def advance_reasoning(self, token: int) -> bool:
        """Moves the reasoning state past the sampled `token`; returns True when `token`
        belongs to the answer, so the grammar must accept it. Always True without a
        reasoning parser."""
        if self.reasoning_parser is None:
            return True
        self.reasoning, answer = self.reasoning_parser.advance(self.reasoning, token)
        return answer

    @property
    def failed(self) -> bool:
        """True when the grammar will never be ready (see `exception`)."""
        return self.exception is not None

    @property
    def error(self) -> str | None:
        """The text of `exception` ("structured_outputs.json: ..."), or None."""
        return None if self.exception is None else str(self.exception)

    @property
    def ready(self) -> bool:
        """True when the grammar is compiled and usable."""
        return self.grammar is not None

    def mark_started(self) -> None:
        """Records that a worker began compiling now (called from the worker thread)."""
        self.compile_started_at = time.monotonic()
        self._started.set()

    def pause(self) -> None:
        """Stops the compile clock (from the worker thread) while the compile waits for
        something that is no request's cost, such as a backend being built; `resume` counts
        on from there."""
        started = self.compile_started_at
        if started is not None:
            self._compiled_s = time.monotonic() - started
        self.compile_started_at = None
        self._started.clear()

    def resume(self) -> None:
        """Restarts the compile clock stopped by `pause`."""
        self.compile_started_at = time.monotonic() - self._compiled_s
        self._started.set()

    def wait(self, timeout_s: float) -> bool:
        """Blocks until the grammar is ready (True) or the request failed (False): at most
        `timeout_s` seconds of compiling, plus however long the job waits for a worker.

        Side effects: those of `poll`.
        """
        while not self.poll(timeout_s):
            future = self.future
            if self.failed or future is None:
                return False
            started = self.compile_started_at
            if started is None:
                # Queued: wake up when a worker takes it (or it finishes without starting).
                self._started.wait(0.05)
                continue
            left = started + timeout_s - time.monotonic()
            # A little past the deadline, so the next poll sees it expired.
            wait_futures([future], timeout=max(0.0, left) + 0.001)
        return True

    def poll(self, timeout_s: float) -> bool:
        """Returns True once the grammar is ready.

        Side effects: takes the grammar from a finished compile job; on a compile error, or
        when compiling has run for more than `timeout_s` seconds, sets `error` and returns False
        (the job is abandoned; its result is dropped).
        """
        if self.grammar is not None:
            return True
        if self.error is not None or self.future is None:
            return False
        future = self.future
        if future.done():
            self.future = None
            try:
                self.grammar = future.result()
            except GrammarCompileError as e:
                self.exception = e
            except InvalidRequestError as e:
                # Malformed constraint found while compiling: still the constraint's fault.
                self.exception = GrammarCompileError(e.param, e.message)
            except Exception as e:  # an engine bug must fail this request, not the engine
                self.exception = GrammarCompileError(
                    f"structured_outputs.{self.params.kind}",
                    f"compiling the grammar failed: {e!r}",
                )
            return self.grammar is not None
        started = self.compile_started_at
        if started is not None and time.monotonic() - started > timeout_s:
            future.cancel()
            self.future = None
            self.timed_out = True
            self.exception = CompileAbortedError.timed_out(self.params.kind, timeout_s)
        return False

    def release(self) -> None:
        """Drops the grammar and abandons any compile job (the request is finished)."""
        if self.future is not None:
            self.future.cancel()
            self.future = None
        self.grammar = None
