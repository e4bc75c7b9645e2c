"""Which definitions of a JSON schema its root uses (docs/architecture.md section 5).

A definition nothing references asserts nothing, so it must not cause a refusal (a `oneOf`
no backend can enforce, say) nor be compiled: `drop_unreferenced_definitions` removes it.

Pure Python.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

_DEFINITIONS = ("$defs", "definitions")


def drop_unreferenced_definitions(root: dict[str, Any]) -> None:
    """Removes, in place, the entries of the root's `$defs`/`definitions` that no `$ref`
    reachable from the root's other keywords points into (through other definitions too).
    Keeps them all when a reference is not a local JSON pointer (an anchor, a `$dynamicRef`,
    a URL), whose target this cannot tell."""
    tables = {key: root[key] for key in _DEFINITIONS if isinstance(root.get(key), dict)}
    if not tables:
        return
    used: set[tuple[str, str]] = set()
    pending: list[Any] = [{k: v for k, v in root.items() if k not in _DEFINITIONS}]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key in ("$dynamicRef", "$recursiveRef"):
            if key in node:
                return
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _target(ref)
            if target is None:
                return
            if target[0] in tables and target not in used:
                table, name = target
                if name in tables[table]:
                    used.add(target)
                    pending.append(tables[table][name])
        pending.extend(v for k, v in node.items() if k != "$ref")
    for key, table in tables.items():
        for name in [n for n in table if (key, n) not in used]:
            del table[name]
        if not table:
            del root[key]


def _target(ref: str) -> tuple[str, str] | None:
    """(table, name) of a local ref into the definitions, ("", "") for another local
    pointer, None for a ref this cannot follow."""
    if ref == "#":
        return ("", "")
    if not ref.startswith("#/"):
        return None
    parts = [unquote(p).replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")]
    if parts[0] in _DEFINITIONS and len(parts) >= 2:
        return (parts[0], parts[1])
    return ("", "")
