"""The tree stays the shape docs/architecture.md describes: every file the document names
exists, no import circle spans more than three modules, the bottom layer reaches nothing
above it, no module grows past 600 lines (the point where a file stops being readable in
one sitting), and every Python file compiles without a warning."""

from __future__ import annotations

import ast
import re
import subprocess
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 600


def _tracked(pattern: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    return out.split()


def _modules() -> dict[str, Path]:
    mods = {}
    for rel in _tracked("vllm/*.py"):
        parts = Path(rel).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = REPO / rel
    return mods


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """The engine modules `path` imports anywhere but under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    skip = {
        id(n) for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in mods else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & mods.keys()


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_every_file_the_architecture_names_exists() -> None:
    tracked = set(_tracked("*"))
    text = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([\w./-]+\.(?:py|cpp|h|sh|md|toml))(?::\w+)?`", text))
    assert len(named) > 100  # the pattern still finds the document's paths
    # A path may be written from any directory down (`backends/xgrammar.py`).
    missing = [p for p in sorted(named)
               if p not in tracked and not any(t.endswith("/" + p) for t in tracked)]
    assert missing == []


def test_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert sorted(_circles(graph)) == [["a", "b", "c"], ["e", "e2"]]


def test_no_import_circle_spans_more_than_three_modules() -> None:
    mods = _modules()
    graph = {name: _imports(path, mods) for name, path in mods.items()}
    assert [c for c in _circles(graph) if len(c) > 3] == []


def test_the_bottom_layer_imports_nothing_of_v1() -> None:
    mods = _modules()
    bottom = [m for m in mods if m in ("vllm.options", "vllm.sampling_params", "vllm.config")
              or m.startswith("vllm.config.")]
    reaching_up = {m: sorted(i for i in _imports(mods[m], mods) if i.startswith("vllm.v1"))
                   for m in bottom}
    assert {m: up for m, up in reaching_up.items() if up} == {}


def test_no_module_is_over_600_lines() -> None:
    long = {rel: n for rel in _tracked("vllm/*.py")
            if (n := len((REPO / rel).read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_python_file_compiles_without_warnings() -> None:
    """No invalid escape sequences and the like: Python warns of them at compile time
    (shown once, when no .pyc exists yet) and will make them errors."""
    warned = {}
    for rel in _tracked("*.py"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compile((REPO / rel).read_text(), rel, "exec")
        if caught:
            warned[rel] = [str(w.message) for w in caught]
    assert warned == {}
