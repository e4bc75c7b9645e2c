"""The engine's structured-output manager: compiles constraints, fills batch bitmasks."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
)
from vllm.v1.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

__all__ = ["StructuredOutputManager", "StructuredOutputRequest"]

# Two compile threads match the two-core machines this runs on; xgrammar's compiler uses
# its own threads inside each compile as well.
_COMPILE_WORKERS = 2


class StructuredOutputManager:
    """Compiles each request's constraint in a thread pool and fills the batch bitmask.

    The backend (and xgrammar itself) is created on the first structured request, so engines
    that never see one never import xgrammar.
    """

    def __init__(self, vllm_config: VllmConfig, tokenizer: Any = None) -> None:
        # Loaded on the first structured request when not given (engine-core processes).
        self._tokenizer = tokenizer
        self._tokenizer_path = vllm_config.model_config.tokenizer
        self._config = vllm_config.structured_outputs_config
        self._vocab_size = int(vllm_config.model_config.vocab_size)
        self._stop_token_ids = list(vllm_config.model_config.eos_token_ids)
        self._max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        # A returned bitmask may still be in use by in-flight batches when the next is filled.
        self._num_buffers = vllm_config.max_concurrent_batches + 1
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._live: dict[str, StructuredOutputRequest] = {}
        self._buffers: list[np.ndarray] = []
        self._next_buffer = 0
        self._closed = False

    @property
    def compile_timeout_s(self) -> float:
        """Seconds a grammar may compile before its request fails."""
        return self._config.compile_timeout_s

    @property
    def num_live_grammars(self) -> int:
        """Requests registered by grammar_init and not yet cleared (for leak checks)."""
        return len(self._live)

    @property
    def backend(self) -> StructuredOutputBackend:
        """The backend, built on first use (about a second).

        Raises ValueError when the tokenizer cannot be loaded.
        """
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._create_backend()
            return self._backend

    def _create_backend(self) -> StructuredOutputBackend:
        if self._tokenizer is None:
            from vllm.transformers_utils.tokenizer import get_tokenizer

            self._tokenizer = get_tokenizer(self._tokenizer_path)
        from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

        return XgrammarBackend(
            self._tokenizer,
            self._vocab_size,
            self._stop_token_ids,
            disable_any_whitespace=self._config.disable_any_whitespace,
        )

    def grammar_init(self, request: Request) -> None:
        """Starts compiling the request's constraint in the background (no-op without one).

        Side effects: registers the request (see num_live_grammars) until `clear`; the
        scheduler polls `request.structured_output_request.poll(compile_timeout_s)`.
        Raises RuntimeError after shutdown.
        """
        so_req = request.structured_output_request
        if so_req is None or so_req.future is not None or so_req.ready or so_req.failed:
            return
        if self._closed:
            raise RuntimeError("StructuredOutputManager: used after shutdown")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_COMPILE_WORKERS, thread_name_prefix="grammar")
        self._live[request.request_id] = so_req
        so_req.future = self._pool.submit(self._compile, so_req)

    def _compile(self, so_req: StructuredOutputRequest) -> StructuredOutputGrammar:
        backend = self.backend
        so_req.mark_started()
        return backend.compile_grammar(so_req.params)

    def validate(self, params: StructuredOutputsParams) -> None:
        """Compiles `params` now, blocking; the engine's later compile is then a cache hit.

        Raises ValueError naming the field when the constraint is invalid or unsupported.
        """
        self.backend.compile_grammar(params)

    def grammar_bitmask(self, requests: dict[str, Request], req_ids: list[str]) -> np.ndarray:
        """Returns int32 [len(req_ids), ceil(vocab/32)]: row i masks the next token of req_ids[i].

        A terminated grammar's row allows every token. The array is a view of a preallocated
        buffer that stays intact through the next `max_concurrent_batches` calls (copy it to
        keep it longer). Raises ValueError for an unknown request, one without a ready grammar,
        or more ids than max_num_seqs.
        """
        if len(req_ids) > self._max_num_seqs:
            raise ValueError(
                f"grammar_bitmask: {len(req_ids)} requests exceed max_num_seqs "
                f"({self._max_num_seqs})"
            )
        if not req_ids:
            return np.zeros((0, (self._vocab_size + 31) // 32), dtype=np.int32)
        grammars: list[StructuredOutputGrammar | None] = []
        for req_id in req_ids:
            request = requests.get(req_id)
            so_req = request.structured_output_request if request is not None else None
            if so_req is None or so_req.grammar is None:
                raise ValueError(f"grammar_bitmask: request {req_id!r} has no ready grammar")
            grammars.append(so_req.grammar)
        bitmask = self._take_buffer()[: len(req_ids)]
        self.backend.fill_bitmasks(grammars, bitmask)
        return bitmask

    def _take_buffer(self) -> np.ndarray:
        if not self._buffers:
            backend = self.backend
            self._buffers = [
                backend.allocate_token_bitmask(self._max_num_seqs) for _ in range(self._num_buffers)
            ]
        buffer = self._buffers[self._next_buffer]
        self._next_buffer = (self._next_buffer + 1) % self._num_buffers
        return buffer

    def clear(self, request: Request) -> None:
        """Forgets a finished request: drops its grammar and abandons its compile job.

        Safe to call more than once, and for requests without a constraint.
        """
        so_req = self._live.pop(request.request_id, None)
        if so_req is not None:
            so_req.release()
        elif request.structured_output_request is not None:
            request.structured_output_request.release()

    def shutdown(self) -> None:
        """Stops the compile threads, drops every grammar and the backend's cache."""
        self._closed = True
        for so_req in self._live.values():
            so_req.release()
        self._live.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        with self._backend_lock:
            if self._backend is not None:
                self._backend.destroy()
                self._backend = None
        self._buffers = []
