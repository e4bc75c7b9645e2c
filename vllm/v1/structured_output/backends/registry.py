"""The structured-output backends of this engine: the class behind a name, and which
backends a server option tries.

The names are listed once, in vllm/options.py (GRAMMAR_BACKENDS): a new backend is one
module with a StructuredOutputBackend subclass plus one line there; the server option
(--structured-outputs-config.backend), the `auto` choice, the compile-check workers and the
per-request `backend` field all read them. Classes are imported on first use, so reading a
name never imports a backend's library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from vllm.options import AUTO, GRAMMAR_BACKENDS, GRAMMAR_ON_REQUEST_ONLY

if TYPE_CHECKING:
    from vllm.v1.structured_output.backends.base import StructuredOutputBackend


def backend_class(name: str) -> type[StructuredOutputBackend]:
    """The class of backend `name`, imported now. KeyError for an unknown name."""
    module, _, cls = GRAMMAR_BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def backends_for(name: str, disable_fallback: bool = False) -> list[str]:
    """The backends a server option tries for a request that names none, in order of
    preference: for "auto" every backend not in GRAMMAR_ON_REQUEST_ONLY (only the first with
    `disable_fallback`), else that one. KeyError when unknown."""
    if name == AUTO:
        names = [n for n in GRAMMAR_BACKENDS if n not in GRAMMAR_ON_REQUEST_ONLY]
        return names[:1] if disable_fallback else names
    if name not in GRAMMAR_BACKENDS:
        raise KeyError(name)
    return [name]


def request_only_for(name: str) -> list[str]:
    """The backends a server option offers only to requests that name them: the
    GRAMMAR_ON_REQUEST_ONLY ones under "auto", none otherwise."""
    return [n for n in GRAMMAR_BACKENDS if n in GRAMMAR_ON_REQUEST_ONLY] if name == AUTO else []
