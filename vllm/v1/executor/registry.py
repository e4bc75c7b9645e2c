"""The executors `--distributed-executor-backend` can name, and the one place they are listed.

Classes are named by import path and imported only when asked for, so that parsing flags
and validating a configuration do not load any executor's dependencies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.executor.abstract import Executor

# name -> ("module:Class", what it runs, for --help). A new executor adds one line here.
BACKENDS: dict[str, tuple[str, str]] = {
    "uni": ("vllm.v1.executor.uniproc_executor:UniProcExecutor",
            "one worker in the engine process"),
    "mp": ("vllm.v1.executor.multiproc_executor:MultiprocExecutor", "one process per rank"),
    "ray": ("vllm.v1.executor.ray_executor:RayExecutor",
            "one Ray actor per rank, across a Ray cluster: pip install -e '.[ray]'"),
}


def names() -> tuple[str, ...]:
    """Every accepted backend name, in registry order."""
    return tuple(BACKENDS)


def describe() -> str:
    """The backends for --help: "uni (...), mp (...) or ray (...)"."""
    parts = [f"{name} ({what})" for name, (_, what) in BACKENDS.items()]
    return ", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else parts[0]


def resolve(backend: str | type) -> type[Executor]:
    """The Executor class for a backend name, or `backend` itself when it is already an
    Executor subclass. Imports the executor's module.

    Raises ValueError (naming the flag) for an unknown name or a class that is not an
    Executor.
    """
    from vllm.v1.executor.abstract import Executor

    if isinstance(backend, type):
        if not issubclass(backend, Executor):
            raise ValueError(
                f"--distributed-executor-backend: a class must subclass Executor, got "
                f"{backend.__qualname__}"
            )
        return backend
    if backend not in BACKENDS:
        allowed = ", ".join(repr(n) for n in names()[:-1]) + f" or {names()[-1]!r}"
        raise ValueError(f"--distributed-executor-backend: must be {allowed}, got {backend!r}")
    module, _, name = BACKENDS[backend][0].partition(":")
    return getattr(importlib.import_module(module), name)
