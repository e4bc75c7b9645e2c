"""Loading the scripts of the repository's `benchmarks/` folder (not a package) in tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str) -> ModuleType:
    """The module `benchmarks/<name>.py`, registered in sys.modules under `name`."""
    path = REPO / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Dataclasses look their module up in sys.modules while the class body runs.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
