"""The structured-output backends of this engine, by name.

A new backend is one module with a StructuredOutputBackend subclass plus one line in
BACKENDS: the server option (--structured-outputs-config.backend), the `auto` choice, the
compile-check workers and the per-request `backend` field all read the names here. Classes
are imported on first use, so reading a name never imports a backend's library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.structured_output.backends.base import StructuredOutputBackend

# Name -> "module:class". Order is preference under "auto": each constraint goes to the
# first backend that enforces it exactly (only the first with `disable_fallback`).
BACKENDS: dict[str, str] = {
    "xgrammar": "vllm.v1.structured_output.backends.xgrammar:XgrammarBackend",
    "guidance": "vllm.v1.structured_output.backends.guidance:GuidanceBackend",
    "outlines": "vllm.v1.structured_output.backends.outlines:OutlinesBackend",
    "lm-format-enforcer":
        "vllm.v1.structured_output.backends.lm_format_enforcer:LMFormatEnforcerBackend",
}

# Backends "auto" never picks on its own: everything they enforce, xgrammar or llguidance
# enforces too (and faster). A request may still name them, and a server may select one.
ON_REQUEST_ONLY: frozenset[str] = frozenset({"outlines", "lm-format-enforcer"})

# Upstream's names for ours, accepted where a request names its backend.
ALIASES: dict[str, str] = {"llguidance": "guidance"}

# The server's choice: every backend in BACKENDS order.
AUTO = "auto"


def server_choices() -> tuple[str, ...]:
    """The values --structured-outputs-config.backend accepts: "auto", then each backend."""
    return (AUTO, *BACKENDS)


def request_names() -> dict[str, str]:
    """The names a request may give its `backend`, each mapped to the backend's own name
    (aliases included; "auto" is not a backend)."""
    return {**{name: name for name in BACKENDS}, **ALIASES}


def backend_class(name: str) -> type[StructuredOutputBackend]:
    """The class of backend `name`, imported now. KeyError for an unknown name."""
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def backends_for(name: str, disable_fallback: bool = False) -> list[str]:
    """The backends a server option tries for a request that names none, in order of
    preference: for "auto" every backend not in ON_REQUEST_ONLY (only the first with
    `disable_fallback`), else that one. KeyError when unknown."""
    if name == AUTO:
        names = [n for n in BACKENDS if n not in ON_REQUEST_ONLY]
        return names[:1] if disable_fallback else names
    if name not in BACKENDS:
        raise KeyError(name)
    return [name]


def request_only_for(name: str) -> list[str]:
    """The backends a server option offers only to requests that name them: the
    ON_REQUEST_ONLY ones under "auto", none otherwise."""
    return [n for n in BACKENDS if n in ON_REQUEST_ONLY] if name == AUTO else []
