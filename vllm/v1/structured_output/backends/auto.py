"""Choosing the backend: per request, the first one that enforces the constraint exactly.

xgrammar is tried first (the faster matcher); when it refuses to enforce the constraint
(UnsupportedConstraintError: a keyword it would drop, a per-request `whitespace_pattern`, an
integer bound past 64 bits) llguidance compiles it instead; when both refuse, the request gets
a 400 that quotes both refusals. Any other compile error (a syntax error, an unsatisfiable
constraint) is final: no second backend is asked. Each backend is built on its first use, so a server whose requests
all suit xgrammar never builds llguidance's vocabulary. Backends the registry offers only on
request (outlines, lm-format-enforcer under `auto`) compile just the requests that name them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from vllm.exceptions import GrammarCompileError, UnsupportedConstraintError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.backends.base import (
    BackendOptions,
    BackendSetup,
    StructuredOutputBackend,
    StructuredOutputGrammar,
)
from vllm.v1.structured_output.backends.registry import (
    backend_class,
    backends_for,
    request_only_for,
)
from vllm.v1.structured_output.schema.normalize import normalize_json_schema

if TYPE_CHECKING:
    from vllm.config import StructuredOutputsConfig

logger = logging.getLogger(__name__)

# Why a request's constraint went to the backend that compiled it (a /metrics label).
FIRST_CHOICE = "first_choice"
FALLBACK = "fallback"


class CompileClock(Protocol):
    """A request's compile time limit (StructuredOutputRequest)."""

    def pause(self) -> None:
        """Stops counting compile time."""

    def resume(self) -> None:
        """Counts on from where pause stopped."""


class AutoBackend(StructuredOutputBackend):
    """Compiles each constraint with the first of its backends that accepts it.

    `factories` are (name, build) pairs in order of preference; `build` runs on the backend's
    first use, under that backend's own lock. `one_of_as_any_of` must be the backends' own
    setting: a JSON schema is checked once here with the backend-neutral checks, whose
    errors are final.
    Thread-safe.
    """

    def __init__(
        self,
        vocab_size: int,
        factories: Sequence[tuple[str, Callable[[], StructuredOutputBackend]]],
        *,
        one_of_as_any_of: bool = False,
        on_request: Sequence[tuple[str, Callable[[], StructuredOutputBackend]]] = (),
        disable_additional_properties: bool = False,
    ) -> None:
        if not factories:
            raise ValueError("factories: at least one backend is needed")
        self.vocab_size = vocab_size
        self._factories = list(factories)
        # Backends used only for requests that name them (GRAMMAR_ON_REQUEST_ONLY in vllm/options.py).
        self._on_request = list(on_request)
        self._one_of_as_any_of = one_of_as_any_of
        # The server's disable_additional_properties: set on every request's constraint.
        self._disable_additional_properties = disable_additional_properties
        self._built: dict[str, StructuredOutputBackend] = {}
        # Guards _built and _owners, held only for lookups: a build holds its backend's
        # own lock, so compiles with built backends never wait behind it.
        self._lock = threading.Lock()
        self._build_locks = {
            name: threading.Lock() for name, _ in self._factories + self._on_request
        }
        # The backend of each grammar class this object has handed out (for fill_bitmasks).
        self._owners: dict[type, StructuredOutputBackend] = {}

    def _backend(
        self,
        name: str,
        build: Callable[[], StructuredOutputBackend],
        clock: CompileClock | None = None,
    ) -> Any:
        """The backend `name`, built now if it was not yet; `clock` is paused while this
        call waits for it to be built (here or by another thread)."""
        with self._lock:
            backend = self._built.get(name)
        if backend is not None:
            return backend
        if clock is not None:
            clock.pause()
        try:
            with self._build_locks[name]:
                with self._lock:
                    backend = self._built.get(name)
                if backend is None:
                    backend = build()
                    with self._lock:
                        self._built[name] = backend
                return backend
        finally:
            if clock is not None:
                clock.resume()

    def backend_named(self, name: str) -> Any:
        """The backend called `name`, built now if it was not yet. KeyError if unknown."""
        return self._backend(name, dict(self._factories + self._on_request)[name])

    def compile_grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """Compiles `params` with the first backend that enforces it exactly (see
        `compile_choosing`)."""
        return self.compile_choosing(params)[0]

    def compile_choosing(
        self, params: StructuredOutputsParams, clock: CompileClock | None = None
    ) -> tuple[StructuredOutputGrammar, str, str]:
        """Compiles `params` with the first backend that enforces it exactly; returns the
        grammar, the backend's name, and why (FIRST_CHOICE, or FALLBACK when an earlier
        backend refused). Builds a backend on its first use, with `clock` paused meanwhile:
        building one (seconds, once per process, maybe by another thread) is no request's
        compile time.

        Raises GrammarCompileError when the constraint is invalid (the first backend's verdict:
        a later backend is tried only when one refuses with UnsupportedConstraintError), and
        an UnsupportedConstraintError quoting every backend's refusal when none can enforce it.
        """
        if self._disable_additional_properties and not params.disable_additional_properties:
            # The server's setting, as if the request had asked for it (backends read it there).
            params = dataclasses.replace(params, disable_additional_properties=True)
        if params.kind == "json":
            # Problems with the schema itself (no value satisfies it, an overlapping oneOf)
            # are no backend's to solve: refused before any backend is tried (or built).
            schema = params.json if isinstance(params.json, dict) else json.loads(params.json)
            normalize_json_schema(
                schema,
                disable_additional_properties=params.disable_additional_properties,
                one_of_as_any_of=self._one_of_as_any_of,
            )
        factories = self._factories
        if params.backend is not None:
            factories = [
                (n, b) for n, b in self._factories + self._on_request if n == params.backend
            ]
            if not factories:
                raise UnsupportedConstraintError(
                    "structured_outputs.backend",
                    f"{params.backend!r} is not enabled on this server (it uses "
                    f"{', '.join(n for n, _ in self._factories + self._on_request)})",
                )
        refusals: list[tuple[str, UnsupportedConstraintError]] = []
        for name, build in factories:
            backend = self._backend(name, build, clock)
            try:
                grammar = backend.compile_grammar(params)
            except UnsupportedConstraintError as e:
                refusals.append((name, e))
                continue
            # Any other GrammarCompileError is the constraint's own fault: final.
            with self._lock:
                self._owners.setdefault(type(grammar), backend)
            if refusals:
                logger.debug(
                    "structured outputs: a %s constraint went to %s because %s",
                    params.kind, name,
                    "; ".join(f"{n} refused it ({e.message})" for n, e in refusals),
                )
            return grammar, name, FALLBACK if refusals else FIRST_CHOICE
        raise _combine(refusals)

    def fill_unterminated(
        self, grammars: list[StructuredOutputGrammar], bitmask: np.ndarray, rows: list[int]
    ) -> None:
        """Fills the rows with one batched call per backend."""
        groups: dict[int, tuple[StructuredOutputBackend, list[Any], list[int]]] = {}
        for grammar, row in zip(grammars, rows, strict=True):
            backend = self._owners[type(grammar)]
            group = groups.setdefault(id(backend), (backend, [], []))
            group[1].append(grammar)
            group[2].append(row)
        for backend, members, member_rows in groups.values():
            backend.fill_unterminated(members, bitmask, member_rows)

    def destroy(self) -> None:
        """Destroys every backend built so far."""
        with self._lock:
            built, self._built = list(self._built.values()), {}
        for backend in built:
            backend.destroy()


def _combine(refusals: list[tuple[str, UnsupportedConstraintError]]) -> GrammarCompileError:
    """The error for a constraint every backend refused to enforce."""
    messages = list(dict.fromkeys(e.message for _, e in refusals))
    if len(messages) == 1:  # one refusal, or the same one from a shared check
        return refusals[0][1]
    detail = "; ".join(f"{name}: {e.message}" for name, e in refusals)
    return UnsupportedConstraintError(
        refusals[0][1].param, f"no structured-output backend can enforce this ({detail})"
    )


def create_backend(
    config: StructuredOutputsConfig,
    tokenizer: Any,
    vocab_size: int,
    stop_token_ids: Sequence[int],
    *,
    prepared: dict[str, Any] | None = None,
    max_threads: int | None = None,
    cache_limit_bytes: int | None = None,
) -> AutoBackend:
    """An AutoBackend over the backends `config.backend` selects (registry.backends_for:
    "auto" gives every registered backend in order, only the first with `disable_fallback`).
    `prepared` maps backend names to what their `prepare` returned (see prepare_backends);
    `tokenizer` may be None only when every backend that is built needs no tokenizer then."""
    options = BackendOptions(
        disable_any_whitespace=bool(config.disable_any_whitespace),
        max_whitespace=config.max_whitespace,
        one_of_as_any_of=config.one_of_as_any_of,
        max_threads=max_threads,
    )
    prepared = prepared or {}

    def build(name: str) -> StructuredOutputBackend:
        setup = BackendSetup(
            tokenizer, vocab_size, stop_token_ids, options, prepared.get(name), cache_limit_bytes
        )
        return backend_class(name).create(setup)

    names = backends_for(config.backend, config.disable_fallback)
    factories = [(name, functools.partial(build, name)) for name in names]
    on_request = [
        (name, functools.partial(build, name)) for name in request_only_for(config.backend)
    ]
    return AutoBackend(
        vocab_size, factories, one_of_as_any_of=config.one_of_as_any_of, on_request=on_request,
        disable_additional_properties=config.disable_additional_properties,
    )


def prepare_backends(
    config: StructuredOutputsConfig,
    tokenizer: Any,
    vocab_size: int,
    stop_token_ids: Sequence[int],
) -> dict[str, Any]:
    """Runs `prepare` of each backend `config` selects (seconds: before forking compile
    workers, so each worker builds its backends in milliseconds); the result is
    create_backend's `prepared`."""
    return {
        name: backend_class(name).prepare(tokenizer, vocab_size, stop_token_ids)
        for name in backends_for(config.backend, config.disable_fallback)
    }
