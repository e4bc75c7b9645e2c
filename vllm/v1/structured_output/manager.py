"""The engine's grammar manager: compiles each request's constraint, fills batch bitmasks."""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm.reasoning import ReasoningParser
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.metrics.engine_stats import GrammarStats
from vllm.v1.structured_output.draft_rows import allow_think, fill_draft_rows, skip_forced
from vllm.v1.structured_output.fast_forward import FastForward, server_mode
from vllm.v1.structured_output.lanes import CompileLanes
from vllm.v1.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request
    from vllm.v1.structured_output.backends.auto import AutoBackend
    from vllm.v1.structured_output.backends.base import StructuredOutputGrammar


class StructuredOutputManager:
    """Compiles each request's constraint in the background and fills the batch bitmask.

    Compiles run on CompileLanes (`compile_workers` threads per lane); a compile's time
    limit counts from when a thread takes it, never the time queued. The backend (and
    xgrammar itself) is created on the first compile, so a process that never compiles
    never imports xgrammar.
    """

    def __init__(self, vllm_config: VllmConfig, tokenizer: Any = None) -> None:
        # Loaded on the first structured request when not given (engine-core processes).
        self._tokenizer = tokenizer
        self._tokenizer_path = vllm_config.model_config.tokenizer
        self._config = vllm_config.structured_outputs_config
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
        self._lanes = CompileLanes(self._config.num_compile_workers)
        self._live: dict[str, StructuredOutputRequest] = {}
        self._buffers: list[np.ndarray] = []
        self._next_buffer = 0
        # Grammar fast-forward: the server's mode, tokens forced one at a time (found with a
        # one-row bitmask) and canonical tokenization of forced text.
        self.fast_forward = FastForward(server_mode(vllm_config), self._load_tokenizer,
                                        lambda: self.backend.allocate_token_bitmask(1))
        self.reasoning_parser: ReasoningParser | None = None
        if self._config.reasoning_parser is not None:
            # An engine-core process is spawned: a plugin's parsers are registered only once
            # its module is imported here too.
            self._config.import_reasoning_parser_plugin()
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

    def make_stats(self) -> GrammarStats:
        """The grammar backends' part of the engine's stats record."""
        return GrammarStats(sorted((b, r, n) for (b, r), n in self.backend_choices().items()))

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
        from vllm.v1.structured_output.backends.auto import create_backend

        return create_backend(
            self._config, self._load_tokenizer(), self._vocab_size, self._stop_token_ids
        )

    def grammar_init(self, request: Request) -> None:
        """Starts compiling the request's constraint in the background (no-op without one).

        Side effects: registers the request (see num_live_grammars) until `clear`; the
        scheduler polls `request.structured_output_request.poll(compile_timeout_s)`. With a
        reasoning parser, sets the request's reasoning state from its prompt, unless
        `enable_in_reasoning` constrains the thinking too (the grammar then applies from the
        first token, as without a parser).
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
        lane = self._lanes.lane(structured_req.params)  # RuntimeError after shutdown
        if self.reasoning_parser is not None and not self._config.enable_in_reasoning:
            structured_req.reasoning_parser = self.reasoning_parser
            structured_req.reasoning = self.reasoning_parser.initial_state(
                request.prompt_token_ids
            )
        self._live[request.request_id] = structured_req
        structured_req.future = lane.submit(self._compile, structured_req, True)

    def start_compile(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Starts compiling `params` for an admission check, on the same lanes and backend
        as requests (so the request's own compile is then a cache hit); the caller waits on
        the result and releases it. Not registered nor counted in backend_choices.
        Raises RuntimeError after shutdown."""
        structured_req = StructuredOutputRequest(params)
        structured_req.future = self._lanes.submit(params, self._compile, structured_req)
        return structured_req

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

    def grammar_bitmask(
        self,
        requests: dict[str, Request],
        req_ids: list[str],
        drafts: dict[str, list[int]] | None = None,
        skip: dict[str, int] | None = None,
    ) -> np.ndarray:
        """Returns int32 [rows, ceil(vocab/32)] masks for the next tokens of `req_ids`, in
        order: one row per request, or 1 + len(drafts[id]) - skip[id] consecutive rows for a
        request with drafts (row j masks the token after its (skip[id] + j)-th draft). The
        first skip[id] drafts are fast-forward tokens, each the only token its position
        allows: the runner samples nothing there, so they get no row.

        A terminated grammar's row allows every token; the row of a reply that may still open
        a thinking block also allows `<think>`. The array is a view of a preallocated
        buffer that stays intact through the next `max_concurrent_batches` calls (copy it to
        keep it longer). Every grammar is left as it was (drafts are accepted, then rolled
        back); rows after a draft the grammar rejects allow every token (fill_draft_rows).
        Raises ValueError for an unknown request, one without a ready grammar, or more rows
        than max_num_seqs x (1 + num_speculative_tokens).
        """
        drafts = drafts or {}
        skip = skip or {}
        num_rows = len(req_ids) + sum(
            len(drafts.get(r, ())) - skip.get(r, 0) for r in req_ids)
        if num_rows > self._max_rows:
            raise ValueError(
                f"grammar_bitmask: {num_rows} rows exceed max_num_seqs x (1 + "
                f"num_speculative_tokens) ({self._max_rows})"
            )
        if not req_ids:
            return np.zeros((0, (self._vocab_size + 31) // 32), dtype=np.int32)
        grammars: list[StructuredOutputGrammar] = []
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
            row += 1 + len(drafts.get(req_id, ())) - skip.get(req_id, 0)
        bitmask = self._take_buffer()[:num_rows]
        # Fast-forward tokens are certain: the first row masks the position after them.
        advanced = [skip_forced(req_id, g, drafts.get(req_id, [])[: skip.get(req_id, 0)])
                    for req_id, g in zip(req_ids, grammars)]
        try:
            self.backend.fill_bitmasks(grammars, bitmask, rows)
            for req_id, grammar, first in zip(req_ids, grammars, rows):
                tokens = drafts.get(req_id, [])[skip.get(req_id, 0):]
                if tokens:
                    fill_draft_rows(req_id, grammar, tokens, bitmask, first)
        finally:
            for grammar, n in zip(grammars, advanced):
                grammar.rollback(n)
        if undecided:
            assert self.reasoning_parser is not None
            allow_think(bitmask, undecided, self.reasoning_parser.start_id)
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
        """Stops the compile threads, drops every grammar and the backend's cache.
        Idempotent."""
        self._lanes.shutdown()
        for structured_req in self._live.values():
            structured_req.release()
        self._live.clear()
        with self._backend_lock:
            if self._backend is not None:
                self._backend.destroy()
                self._backend = None
        self._buffers = []
