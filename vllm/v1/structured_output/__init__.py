"""The engine's structured-output manager: compiles constraints, fills batch bitmasks."""

from __future__ import annotations

import collections
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm.exceptions import InvalidRequestError
from vllm.reasoning import ReasoningParser
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.compile_pool import CompileAbortedError
from vllm.v1.structured_output.limits import (
    SMALL_CONSTRAINT_LENGTH,
    check_constraint_limits,
    constraint_key,
    constraint_length,
)
from vllm.v1.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.structured_output.backend_auto import AutoBackend
    from vllm.v1.structured_output.backend_types import StructuredOutputGrammar
    from vllm.v1.request import Request
    from vllm.v1.structured_output.compile_pool import CompileCheckPool

__all__ = ["CompileAbortedError", "StructuredOutputManager", "StructuredOutputRequest"]

# Verdicts remembered per constraint (a digest and at most a short message each), so that a
# repeated schema is not compiled again to be checked.
_REMEMBERED_VERDICTS = 4096
_MISSING = object()


class StructuredOutputManager:
    """Compiles each request's constraint in the background and fills the batch bitmask.

    Compiles run on two lanes of `compile_workers` threads each: constraints up to
    SMALL_CONSTRAINT_LENGTH characters on one, bigger ones on the other, so that a choice or a
    short regex never waits behind big schemas. A compile's time limit counts from when a
    thread takes it, never the time queued.

    With `check_in_processes` (the API server), `check` compiles in worker processes that are
    killed at the time limit (see compile_pool); elsewhere nothing but threads is started.
    The backend (and xgrammar itself) is created on the first compile in this process, so a
    process that never compiles never imports xgrammar.
    """

    def __init__(
        self, vllm_config: VllmConfig, tokenizer: Any = None, *, check_in_processes: bool = False
    ) -> None:
        # Loaded on the first structured request when not given (engine-core processes).
        self._tokenizer = tokenizer
        self._tokenizer_path = vllm_config.model_config.tokenizer
        self._config = vllm_config.structured_outputs_config
        self._num_workers = self._config.num_compile_workers
        self._vocab_size = int(vllm_config.model_config.vocab_size)
        self._stop_token_ids = list(vllm_config.model_config.eos_token_ids)
        # Bitmask rows one step may need: a request with drafts has a row per position.
        self._max_rows = vllm_config.scheduler_config.max_num_seqs * (
            1 + vllm_config.num_speculative_tokens
        )
        # A returned bitmask may still be in use by in-flight batches when the next is filled.
        self._num_buffers = vllm_config.max_concurrent_batches + 1
        self._backend: AutoBackend | None = None
        self._backend_lock = threading.Lock()
        self._choices: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lanes_lock = threading.Lock()
        self._small_lane: ThreadPoolExecutor | None = None
        self._big_lane: ThreadPoolExecutor | None = None
        # Threads that wait on in-process checks when worker processes are not available.
        self._waiters: ThreadPoolExecutor | None = None
        self._use_processes = check_in_processes and hasattr(os, "fork")
        self._check_pool: CompileCheckPool | None = None
        # Constraint key -> None (it passed) or the error it failed with (re-raised as a copy).
        self._verdicts: collections.OrderedDict[str, InvalidRequestError | None] = (
            collections.OrderedDict()
        )
        self._verdicts_lock = threading.Lock()
        self._live: dict[str, StructuredOutputRequest] = {}
        self._buffers: list[np.ndarray] = []
        self._next_buffer = 0
        self._closed = False
        self.reasoning_parser: ReasoningParser | None = None
        if self._config.reasoning_parser is not None:
            self.reasoning_parser = ReasoningParser.create(
                self._config.reasoning_parser, self._load_tokenizer()
            )

    def _load_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from vllm.transformers_utils.tokenizer import get_tokenizer

            self._tokenizer = get_tokenizer(self._tokenizer_path)
        return self._tokenizer

    @property
    def compile_timeout_s(self) -> float:
        """Seconds a grammar may compile before its request fails."""
        return self._config.compile_timeout_s

    @property
    def num_live_grammars(self) -> int:
        """Requests registered by grammar_init and not yet cleared (for leak checks)."""
        return len(self._live)

    def backend_choices(self) -> dict[tuple[str, str], int]:
        """Requests compiled so far (by grammar_init) by (backend, reason): reason is
        "first_choice", or "fallback" when an earlier backend could not enforce the
        constraint."""
        with self._backend_lock:
            return dict(self._choices)

    @property
    def backend(self) -> AutoBackend:
        """The backend, built on first use (about two seconds).

        Raises ValueError when the tokenizer cannot be loaded.
        """
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._create_backend()
            return self._backend

    def _create_backend(self) -> AutoBackend:
        from vllm.v1.structured_output.backend_auto import create_backend

        return create_backend(
            self._config, self._load_tokenizer(), self._vocab_size, self._stop_token_ids
        )

    def _lane(self, params: StructuredOutputsParams) -> ThreadPoolExecutor:
        """The compile lane for `params` (created on first use). RuntimeError after shutdown."""
        small = constraint_length(params, cap=SMALL_CONSTRAINT_LENGTH) <= SMALL_CONSTRAINT_LENGTH
        with self._lanes_lock:
            if self._closed:
                raise RuntimeError("StructuredOutputManager: used after shutdown")
            if self._small_lane is None:
                self._small_lane = ThreadPoolExecutor(
                    self._num_workers, thread_name_prefix="grammar-small"
                )
                self._big_lane = ThreadPoolExecutor(
                    self._num_workers, thread_name_prefix="grammar-big"
                )
            return self._small_lane if small else self._big_lane

    def grammar_init(self, request: Request) -> None:
        """Starts compiling the request's constraint in the background (no-op without one).

        Side effects: registers the request (see num_live_grammars) until `clear`; the
        scheduler polls `request.structured_output_request.poll(compile_timeout_s)`. With a
        reasoning parser, sets the request's reasoning state from its prompt.
        Raises RuntimeError after shutdown.
        """
        structured_req = request.structured_output_request
        if (
            structured_req is None
            or structured_req.future is not None
            or structured_req.ready
            or structured_req.failed
        ):
            return
        if self._closed:
            raise RuntimeError("StructuredOutputManager: used after shutdown")
        lane = self._lane(structured_req.params)
        if self.reasoning_parser is not None:
            structured_req.reasoning_parser = self.reasoning_parser
            structured_req.reasoning = self.reasoning_parser.initial_state(
                request.prompt_token_ids
            )
        self._live[request.request_id] = structured_req
        structured_req.future = lane.submit(self._compile, structured_req, True)

    def _compile(
        self, structured_req: StructuredOutputRequest, count: bool = False
    ) -> StructuredOutputGrammar:
        backend = self.backend
        structured_req.mark_started()
        grammar, name, reason = backend.compile_choosing(
            structured_req.params, clock=structured_req
        )
        if count:  # a request's own compile, not an admission check
            with self._backend_lock:
                self._choices[(name, reason)] += 1
        return grammar

    # ------------------------------------------------------------------ validation

    def validate(self, params: StructuredOutputsParams) -> None:
        """Checks `params` before its request is admitted; blocks while it compiles here.

        The compile runs on the lanes, within `compile_timeout_s` of compiling (a compile past
        it is abandoned: its thread finishes it in the background, and the engine's own compile
        of the same constraint is then a cache hit). A constraint already checked (by `check`
        or an earlier call) is not compiled again.
        Raises GrammarCompileError naming the field when the constraint is over a configured
        limit, does not compile, is unsatisfiable, or is too slow to compile
        (CompileAbortedError), and InvalidRequestError when it is malformed.
        """
        check_constraint_limits(params, self._config)
        key = constraint_key(params)
        if self._recall(key):
            return
        self._compile_here(params, key)

    def _compile_here(self, params: StructuredOutputsParams, key: str) -> float:
        """Compiles `params` on a lane within the time limit; returns the compile's seconds."""
        structured_req = StructuredOutputRequest(params)
        structured_req.future = self._lane(params).submit(self._compile, structured_req)
        ok = structured_req.wait(self.compile_timeout_s)
        seconds = time.monotonic() - (structured_req.compile_started_at or time.monotonic())
        structured_req.release()
        if not ok:
            error = structured_req.exception
            if error is None:  # never submitted: a bug here, not the constraint's fault
                raise RuntimeError("StructuredOutputManager: the compile job was lost")
            if not structured_req.timed_out:  # a timeout depends on the load: never remembered
                self._remember(key, error)
            raise error
        self._remember(key, None)
        return seconds

    def check(self, params: StructuredOutputsParams) -> Future[float]:
        """Starts checking `params` without blocking; returns a future of the compile's seconds.

        Runs the limit checks now (raising GrammarCompileError naming the field), then
        compiles in a killable worker process with `check_in_processes` (else on the lanes
        here). The future raises GrammarCompileError when the constraint does not compile, is
        unsatisfiable or too slow (CompileAbortedError), and RuntimeError when the compile
        workers cannot run.
        Cancelling it drops the check. A later `validate` of a passed constraint returns at
        once. Raises RuntimeError after shutdown.
        """
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
        if self._use_processes:
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
        with self._lanes_lock:
            if self._closed:
                raise RuntimeError("StructuredOutputManager: used after shutdown")
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
        with self._lanes_lock:
            if self._closed:
                raise RuntimeError("StructuredOutputManager: used after shutdown")
            if self._waiters is None:
                # Waiting costs no CPU; the lanes bound the compiles themselves.
                self._waiters = ThreadPoolExecutor(
                    4 * self._num_workers, thread_name_prefix="grammar-check"
                )
            return self._waiters

    def _recall(self, key: str) -> bool:
        """True when the constraint passed before; raises (a copy of) its error when it
        failed."""
        with self._verdicts_lock:
            verdict = self._verdicts.get(key, _MISSING)
            if verdict is _MISSING:
                return False
            self._verdicts.move_to_end(key)
        if verdict is not None:
            raise verdict.copy()
        return True

    def _remember(self, key: str, error: InvalidRequestError | None) -> None:
        with self._verdicts_lock:
            self._verdicts[key] = error
            self._verdicts.move_to_end(key)
            while len(self._verdicts) > _REMEMBERED_VERDICTS:
                self._verdicts.popitem(last=False)

    # ------------------------------------------------------------------ bitmasks

    def grammar_bitmask(
        self,
        requests: dict[str, Request],
        req_ids: list[str],
        drafts: dict[str, list[int]] | None = None,
    ) -> np.ndarray:
        """Returns int32 [rows, ceil(vocab/32)] masks for the next tokens of `req_ids`, in
        order: one row per request, or 1 + len(drafts[id]) consecutive rows for a request
        with drafts (row j masks the token after its j-th draft).

        A terminated grammar's row allows every token; the row of a reply that may still open
        a thinking block also allows `<think>`. The array is a view of a preallocated
        buffer that stays intact through the next `max_concurrent_batches` calls (copy it to
        keep it longer). Every grammar is left as it was (drafts are accepted, then rolled
        back); rows after a draft the grammar rejects allow every token (_fill_draft_rows).
        Raises ValueError for an unknown request, one without a ready grammar, or more rows
        than max_num_seqs x (1 + num_speculative_tokens).
        """
        drafts = drafts or {}
        num_rows = len(req_ids) + sum(len(drafts.get(r, ())) for r in req_ids)
        if num_rows > self._max_rows:
            raise ValueError(
                f"grammar_bitmask: {num_rows} rows exceed max_num_seqs x (1 + "
                f"num_speculative_tokens) ({self._max_rows})"
            )
        if not req_ids:
            return np.zeros((0, (self._vocab_size + 31) // 32), dtype=np.int32)
        grammars: list[StructuredOutputGrammar | None] = []
        rows: list[int] = []
        undecided: list[int] = []
        row = 0
        for req_id in req_ids:
            request = requests.get(req_id)
            structured_req = request.structured_output_request if request is not None else None
            if structured_req is None or structured_req.grammar is None:
                raise ValueError(f"grammar_bitmask: request {req_id!r} has no ready grammar")
            grammars.append(structured_req.grammar)
            rows.append(row)
            if structured_req.undecided:
                undecided.append(row)
            row += 1 + len(drafts.get(req_id, ()))
        bitmask = self._take_buffer()[:num_rows]
        self.backend.fill_bitmasks(grammars, bitmask, rows)
        for req_id, grammar, first in zip(req_ids, grammars, rows):
            tokens = drafts.get(req_id)
            if tokens:
                _fill_draft_rows(req_id, grammar, tokens, bitmask, first)
        if undecided:
            assert self.reasoning_parser is not None
            start = self.reasoning_parser.start_id
            word = bitmask[:, start // 32].view(np.uint32)
            word[undecided] |= np.uint32(1 << (start % 32))
        return bitmask

    def _take_buffer(self) -> np.ndarray:
        if not self._buffers:
            backend = self.backend
            self._buffers = [
                backend.allocate_token_bitmask(self._max_rows) for _ in range(self._num_buffers)
            ]
        buffer = self._buffers[self._next_buffer]
        self._next_buffer = (self._next_buffer + 1) % self._num_buffers
        return buffer

    def clear(self, request: Request) -> None:
        """Forgets a finished request: drops its grammar and abandons its compile job.

        Safe to call more than once, and for requests without a constraint.
        """
        structured_req = self._live.pop(request.request_id, None)
        if structured_req is not None:
            structured_req.release()
        elif request.structured_output_request is not None:
            request.structured_output_request.release()

    def shutdown(self) -> None:
        """Stops the compile threads and processes, drops every grammar and the backend's
        cache. Idempotent."""
        with self._lanes_lock:
            self._closed = True
            lanes = [self._small_lane, self._big_lane, self._waiters]
            self._small_lane = self._big_lane = self._waiters = None
            pool, self._check_pool = self._check_pool, None
        for structured_req in self._live.values():
            structured_req.release()
        self._live.clear()
        for lane in lanes:
            if lane is not None:
                lane.shutdown(wait=False, cancel_futures=True)
        if pool is not None:
            pool.shutdown()
        with self._backend_lock:
            if self._backend is not None:
                self._backend.destroy()
                self._backend = None
        self._buffers = []


def _fill_draft_rows(
    req_id: str,
    grammar: StructuredOutputGrammar,
    drafts: list[int],
    bitmask: np.ndarray,
    first: int,
) -> None:
    """Fills rows first+1 .. first+len(drafts): the masks after each draft in turn, by
    accepting the drafts and rolling them back.

    Drafts proposed one step stale (async scheduling) assumed tokens that may not have
    come, so the grammar may reject one. Rows from the first rejected draft on allow every
    token: the target's sample at the row before it is masked correctly and cannot equal the
    rejected draft, so verification stops there and never reads them."""
    valid = grammar.validate_tokens(drafts)
    accepted = 0
    try:
        for j, token in enumerate(valid, start=1):
            if not grammar.accept_tokens(req_id, [token]):
                break  # validate_tokens said it would: a backend bug, logged there
            accepted += 1
            grammar.fill_bitmask(bitmask, first + j)
    finally:
        grammar.rollback(accepted)
    bitmask[first + accepted + 1 : first + len(drafts) + 1] = -1
