"""Helpers for starting the engine's own child processes."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Keeps spawn from re-running the parent's main script in a child started meanwhile.

    Our children need nothing from it (their targets and arguments live in vllm), and a script
    without an `if __name__ == "__main__"` guard would otherwise start a second server or
    engine. Side effect: `__main__.__spec__` and `__file__` are hidden until the block exits.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved_spec = getattr(main, "__spec__", None)
    had_file = hasattr(main, "__file__")
    saved_file = getattr(main, "__file__", None)
    try:
        main.__spec__ = None
        if had_file:
            del main.__file__
        yield
    finally:
        main.__spec__ = saved_spec
        if had_file:
            main.__file__ = saved_file
