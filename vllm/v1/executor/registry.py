"""The Executor class behind a `--distributed-executor-backend` name.

The names and their classes' import paths are listed once, in vllm/options.py (EXECUTORS);
classes are imported only when asked for, so that parsing flags does not load any
executor's dependencies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from vllm.options import check_executor_name

if TYPE_CHECKING:
    from vllm.v1.executor.abstract import Executor

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
    module, _, name = check_executor_name(backend).path.partition(":")
    return getattr(importlib.import_module(module), name)
