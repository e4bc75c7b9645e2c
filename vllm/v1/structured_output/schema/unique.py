"""`uniqueItems: true` written with keywords the backends enforce (docs/architecture.md
section 5). No grammar can say "all items differ" of free items, so each rewrite is stricter
than the schema, never wrong:

- an array that may hold at most one item: at most one item;
- items of a short list of values (`enum`, `const`, booleans): the arrays that list distinct
  values in the list's order, as an `anyOf` of `prefixItems` tuples (at most MAX_TUPLES);
- string items (two to MAX_BINS of them required): `minItems` items whose first characters
  lie in successive, disjoint ranges (so they differ, and the array is sorted by its first
  characters), and no more.

Anything else keeps `uniqueItems`, for the backends to refuse naming it.

Pure Python.
"""

from __future__ import annotations

import itertools
from typing import Any

from vllm.v1.structured_output.schema.facts import (
    canonical,
    decide,
    is_number,
    kinds,
    resolve,
    values,
)
from vllm.v1.structured_output.schema.merge import intersect

# The most tuples one array of listed values becomes.
MAX_TUPLES = 64
# The most string items told apart by their first character.
MAX_BINS = 8
# Where successive bins of first characters start (after the first, which starts at the
# space): split points spread over the lowercase letters, where most words start; the last
# bin runs to '~'. Characters outside printable ASCII start no item.
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def rewrite_unique_items(node: dict[str, Any], root: dict[str, Any]) -> None:
    """Replaces, in place, `uniqueItems: true` of `node` by one of the stricter forms above
    when one applies; leaves it otherwise."""
    if node.get("uniqueItems") is not True:
        return
    low = node.get("minItems", 0)
    high = node.get("maxItems")
    if not is_number(low) or (high is not None and not is_number(high)):
        return
    if low <= 1:
        del node["uniqueItems"]
        node["maxItems"] = min(high, 1) if high is not None else 1
        return
    if "prefixItems" in node or "contains" in node or (high is not None and high < low):
        return
    items = node.get("items", True)
    if _list_tuples(node, items, int(low), high, root) or _bin_strings(node, items, int(low),
                                                                        root):
        del node["uniqueItems"]


def _domain(items: Any, root: dict[str, Any]) -> list[Any] | None:
    """The values an item may take, in the schema's order, when it lists them."""
    schema = resolve(items, root)
    if not isinstance(schema, dict):
        return None
    listed = values(schema, root)
    if listed is None:
        if kinds(schema, root) != {"boolean"}:
            return None
        candidates: list[Any] = [False, True]
    else:
        candidates = [schema["const"]] if "const" in schema else list(schema["enum"])
    out: list[Any] = []
    seen: set[str] = set()
    for value in candidates:
        text = canonical(value)  # 1 and 1.0 are one value to uniqueItems
        if text not in seen and decide(value, schema, root) is True:
            seen.add(text)
            out.append(value)
    return out


def _list_tuples(node: dict[str, Any], items: Any, low: int, high: Any,
                 root: dict[str, Any]) -> bool:
    domain = _domain(items, root)
    if domain is None or len(domain) < low:
        return False
    top = len(domain) if high is None else min(len(domain), int(high))
    tuples: list[dict[str, Any]] = []
    for size in range(low, top + 1):
        for chosen in itertools.combinations(domain, size):
            if len(tuples) == MAX_TUPLES:
                break
            tuples.append({"prefixItems": [{"const": v} for v in chosen], "items": False,
                           "minItems": size})
    node.pop("items", None)
    node.setdefault("allOf", []).append(
        tuples[0] if len(tuples) == 1 else {"anyOf": tuples}
    )
    return True


def first_character_bins(count: int) -> list[str]:
    """`count` patterns of strings by their first character: disjoint, in ascending order,
    together covering the strings that start with printable ASCII."""
    step = len(_LETTERS) / count
    starts = [_LETTERS[round(i * step)] for i in range(1, count)]
    lows = ["\\u0020", *starts]
    highs = [chr(ord(s) - 1) for s in starts] + ["~"]
    return [f"^[{lo}-{hi}]" for lo, hi in zip(lows, highs)]


def _bin_strings(node: dict[str, Any], items: Any, low: int, root: dict[str, Any]) -> bool:
    if low > MAX_BINS or kinds(items, root) != {"string"}:
        return False
    prefix = []
    for pattern in first_character_bins(low):
        part = {"type": "string", "pattern": pattern}
        merged = intersect(items, part, root)
        prefix.append({"allOf": [items, part]} if merged is None else merged)
    node["prefixItems"] = prefix
    node["items"] = False
    node["maxItems"] = low
    return True
