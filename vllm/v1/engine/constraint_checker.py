"""The front end's constraint checker: refuses a constraint before its request is admitted."""

from __future__ import annotations

import collections
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from vllm.exceptions import InvalidRequestError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.fast_forward import check_request_mode, server_mode
from vllm.v1.structured_output.compile_pool import CompileAbortedError
from vllm.v1.structured_output.limits import (
    SMALL_CONSTRAINT_LENGTH,
    check_constraint_limits,
    constraint_key,
)
from vllm.v1.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.reasoning import ReasoningParser
    from vllm.v1.structured_output.compile_pool import CompileCheckPool

# Verdicts remembered per constraint (a digest and at most a short message each), so that a
# repeated schema is not compiled again to be checked.
_REMEMBERED_VERDICTS = 4096
_MISSING = object()


class ConstraintChecker:
    """Checks each request's constraint (limits, then a compile within the time limit) and
    remembers the verdict per constraint.

    `check` (the API server's, off its event loop) compiles in worker processes killed at
    the time limit (see compile_pool), started on the first check; without fork it waits on
    threads instead. `validate` (the input processor's) compiles with `grammars`: the
    engine's own manager in the offline engine, so the request's compile is then a cache
    hit; when none is given the checker builds its own, whose backend is created on the
    first in-process compile.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        tokenizer: Any = None,
        grammars: StructuredOutputManager | None = None,
    ) -> None:
        self._owns_grammars = grammars is None
        self._grammars = grammars or StructuredOutputManager(vllm_config, tokenizer)
        self._tokenizer_path = vllm_config.model_config.tokenizer
        self._config = vllm_config.structured_outputs_config
        # The most fast-forward a request may ask for here.
        self._fast_forward = server_mode(vllm_config)
        self._num_workers = self._config.num_compile_workers
        self._vocab_size = int(vllm_config.model_config.vocab_size)
        self._stop_token_ids = list(vllm_config.model_config.eos_token_ids)
        self._lock = threading.Lock()
        self._closed = False
        # Threads that wait on in-process checks when worker processes are not available.
        self._waiters: ThreadPoolExecutor | None = None
        self._check_pool: CompileCheckPool | None = None
        # Constraint key -> None (it passed) or the error it failed with (re-raised as a copy).
        self._verdicts: collections.OrderedDict[str, InvalidRequestError | None] = (
            collections.OrderedDict()
        )

    @property
    def compile_timeout_s(self) -> float:
        """Seconds a constraint may compile before it is refused."""
        return self._config.compile_timeout_s

    @property
    def reasoning_parser(self) -> ReasoningParser | None:
        """The server's --reasoning-parser (None without one); constraints apply only to
        the answer after the thinking."""
        return self._grammars.reasoning_parser

    def validate(self, params: StructuredOutputsParams) -> None:
        """Checks `params` before its request is admitted; blocks while it compiles here.

        The compile runs on the manager's lanes, within `compile_timeout_s` of compiling (a
        compile past it is abandoned: its thread finishes it in the background, and the
        engine's own compile of the same constraint is then a cache hit). A constraint
        already checked (by `check` or an earlier call) is not compiled again.
        Raises InvalidRequestError naming structured_outputs.fast_forward when the request
        asks for more fast-forward than the server allows, GrammarCompileError naming the
        field when the constraint is over a configured limit, does not compile, is
        unsatisfiable, or is too slow to compile (CompileAbortedError), and
        InvalidRequestError when it is malformed.
        """
        check_request_mode(params.fast_forward, self._fast_forward)
        check_constraint_limits(params, self._config)
        key = constraint_key(params)
        if self._recall(key):
            return
        self._compile_here(params, key)

    def _compile_here(self, params: StructuredOutputsParams, key: str) -> float:
        """Compiles `params` on a lane within the time limit; returns the compile's seconds."""
        structured_req = self._grammars.start_compile(params)
        ok = structured_req.wait(self.compile_timeout_s)
        seconds = time.monotonic() - (structured_req.compile_started_at or time.monotonic())
        structured_req.release()
        if not ok:
            error = structured_req.exception
            if error is None:  # never submitted: a bug here, not the constraint's fault
                raise RuntimeError("ConstraintChecker: the compile job was lost")
            if not structured_req.timed_out:  # a timeout depends on the load: never remembered
                self._remember(key, error)
            raise error
        self._remember(key, None)
        return seconds

    def check(self, params: StructuredOutputsParams) -> Future[float]:
        """Starts checking `params` without blocking; returns a future of the compile's seconds.

        Runs the fast-forward and limit checks now (raising InvalidRequestError or
        GrammarCompileError naming the field), then
        compiles in a killable worker process (on the lanes here where fork is missing). The
        future raises GrammarCompileError when the constraint does not compile, is
        unsatisfiable or too slow (CompileAbortedError), and RuntimeError when the compile
        workers cannot run.
        Cancelling it drops the check. A later `validate` of a passed constraint returns at
        once. Raises RuntimeError after shutdown.
        """
        check_request_mode(params.fast_forward, self._fast_forward)
        length = check_constraint_limits(params, self._config)
        key = constraint_key(params)
        future: Future[float]
        try:
            remembered = self._recall(key)
        except InvalidRequestError as e:
            future = Future()
            future.set_exception(e)
            return future
        if remembered:
            future = Future()
            future.set_result(0.0)
            return future
        if hasattr(os, "fork"):
            future = self._pool().submit(params, small=length <= SMALL_CONSTRAINT_LENGTH)
        else:
            future = self._waiter_pool().submit(self._compile_here, params, key)

        def remember(done: Future[float]) -> None:
            if done.cancelled():
                return
            error = done.exception()
            if error is None:
                self._remember(key, None)
            elif isinstance(error, InvalidRequestError) and not isinstance(
                error, CompileAbortedError
            ):
                self._remember(key, error)

        future.add_done_callback(remember)
        return future

    def _pool(self) -> CompileCheckPool:
        with self._lock:
            if self._closed:
                raise RuntimeError("ConstraintChecker: used after shutdown")
            if self._check_pool is None:
                from vllm.v1.structured_output.compile_pool import (
                    BackendChecker,
                    CompileCheckPool,
                )

                checker = BackendChecker(
                    tokenizer=str(self._tokenizer_path),
                    vocab_size=self._vocab_size,
                    stop_token_ids=self._stop_token_ids,
                    config=self._config,
                )
                self._check_pool = CompileCheckPool(
                    checker, self._num_workers, self.compile_timeout_s
                )
            return self._check_pool

    def _waiter_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("ConstraintChecker: used after shutdown")
            if self._waiters is None:
                # Waiting costs no CPU; the lanes bound the compiles themselves.
                self._waiters = ThreadPoolExecutor(
                    4 * self._num_workers, thread_name_prefix="grammar-check"
                )
            return self._waiters

    def _recall(self, key: str) -> bool:
        """True when the constraint passed before; raises (a copy of) its error when it
        failed."""
        with self._lock:
            verdict = self._verdicts.get(key, _MISSING)
            if verdict is _MISSING:
                return False
            self._verdicts.move_to_end(key)
        if verdict is not None:
            raise verdict.copy()
        return True

    def _remember(self, key: str, error: InvalidRequestError | None) -> None:
        with self._lock:
            self._verdicts[key] = error
            self._verdicts.move_to_end(key)
            while len(self._verdicts) > _REMEMBERED_VERDICTS:
                self._verdicts.popitem(last=False)

    def shutdown(self) -> None:
        """Stops the check processes and threads (and the checker's own manager, when it
        built one). Idempotent."""
        with self._lock:
            self._closed = True
            waiters, self._waiters = self._waiters, None
            pool, self._check_pool = self._check_pool, None
        if waiters is not None:
            waiters.shutdown(wait=False, cancel_futures=True)
        if pool is not None:
            pool.shutdown()
        if self._owns_grammars:
            self._grammars.shutdown()
