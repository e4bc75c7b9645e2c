r"""JSON-schema `pattern`s in the forms every backend reads alike (docs/architecture.md section 5).

A pattern matches anywhere in the string (`"^a"` holds for "ax"), while xgrammar, outlines and
lm-format-enforcer match a pattern against the whole string. `anchor` writes a pattern so that
both readings agree: `^[\s\S]*(?:P)[\s\S]*$`, without the padding on a side the pattern
anchors itself ("ax" failed `"^a"` under xgrammar; found by the differential check).

Two everyday lookaround idioms are written without lookarounds, which no backend compiles.
Both rewrites are exact:

- "contains one of each": `^(?=.*[a-z])(?=.*[0-9]).+$` (passwords) holds for the strings of
  `.` that contain each class; written as the alternatives of the orders in which the classes
  first appear, `^(?:.*[a-z].*[0-9].*|.*[0-9].*[a-z].*)$`, at most 4 classes (24 orders),
  with the body `.+` or `.*` (a counted body would need its length beside the pattern,
  which Python's `$`, matching before a final newline, reads differently).
- "not at the ends": `^(?!-)[a-z0-9-]{1,63}(?<!-)$` (DNS labels) holds for the strings of
  the class whose first and last characters are not the excluded one; written with the class
  without that character at the ends, `^(?:[a-z0-9]|[a-z0-9][a-z0-9-]{0,61}[a-z0-9])$`.

Any other lookaround stays, for the backends to refuse.

Pure Python.
"""

from __future__ import annotations

import itertools
import re
import re._constants as sre_constants
import re._parser as sre_parse
from typing import Any

from vllm.exceptions import UnsupportedConstraintError
from vllm.v1.structured_output.schema.regex_tree import children

# One character of a pattern: a bracket class, an escape, or a plain character.
_ATOM = r"(?:\[(?:\\.|[^\]\\])+\]|\\[^\s]|[^\\()\[\]{}.*+?|^$])"
_CONTAINS = re.compile(r"^\^((?:\(\?=\.\*" + _ATOM + r"\))+)(\.\+|\.\*)\$$")
_LOOKAHEAD_ATOM = re.compile(r"\(\?=\.\*(" + _ATOM + r")\)")
_ENDS = re.compile(
    r"^\^(?:\(\?!(" + _ATOM + r")\))?(\[(?:\\.|[^\]\\])+\])(\+|\*|\{\d+(?:,\d*)?\})"
    r"(?:\(\?<!(" + _ATOM + r")\))?\$$"
)
_MAX_CLASSES = 4


_STARTS = (sre_constants.AT_BEGINNING, sre_constants.AT_BEGINNING_STRING)
_ENDS_AT = (sre_constants.AT_END, sre_constants.AT_END_STRING)
# Any character, newlines included: what a pattern may have around the part it matches.
_ANY = "[\\s\\S]*"


def rewrite_anchors(node: dict[str, Any], path: str) -> None:
    """Writes, in place, `node`'s `pattern` and `patternProperties` names with `anchor`.
    Raises UnsupportedConstraintError naming the pattern when an anchor inside it (`^a|b$`,
    `\\b`) leaves no such spelling."""
    if isinstance(node.get("pattern"), str):
        node["pattern"] = _anchored_or_refuse(node["pattern"], f"{path}/pattern")
    table = node.get("patternProperties")
    if isinstance(table, dict):
        node["patternProperties"] = {
            _anchored_or_refuse(name, f"{path}/patternProperties"): sub
            for name, sub in table.items()
        }


def _anchored_or_refuse(pattern: str, path: str) -> str:
    written = anchor(pattern)
    if written is None:
        raise UnsupportedConstraintError(
            "structured_outputs.json",
            f"at {path}: pattern {pattern!r} has an anchor or word boundary inside it",
        )
    return written


def anchor(pattern: str) -> str | None:
    """`pattern`, matched anywhere in a string, written to match whole strings: the same
    language read either way. Unchanged when anchored at both ends or unparsable (the
    backends then report it); None when an anchor stands inside the pattern."""
    try:
        items = list(sre_parse.parse(pattern))
    except (re.error, RecursionError, OverflowError):
        return pattern
    if _edge(items, 0, _STARTS) and _edge(items, -1, _ENDS_AT):
        return pattern  # whole already, `^a$|^b$` (as the negation rewrites write) included
    starts = bool(items) and items[0][0] is sre_constants.AT and items[0][1] in _STARTS
    ends = bool(items) and items[-1][0] is sre_constants.AT and items[-1][1] in _ENDS_AT
    inner = items[1 if starts else 0:len(items) - 1 if ends else len(items)]
    if _has_anchor(inner):
        return None
    if starts and ends:
        return pattern
    core = pattern
    if starts:
        if not core.startswith("^"):
            return None  # \A
        core = core[1:]
    if ends:
        if not core.endswith("$"):
            return None  # \Z
        core = core[:-1]
    return "^" + ("" if starts else _ANY) + "(?:" + core + ")" + ("" if ends else _ANY) + "$"


def _edge(items: list[Any], index: int, anchors: tuple[Any, ...]) -> bool:
    """Whether every way through parsed `items` has one of `anchors` first (index 0) or last
    (index -1), through alternations and groups."""
    if not items:
        return False
    op, arg = items[index]
    if op is sre_constants.AT:
        return arg in anchors
    if op is sre_constants.BRANCH:
        return all(_edge(list(branch), index, anchors) for branch in arg[1])
    if op is sre_constants.SUBPATTERN:
        return _edge(list(arg[-1]), index, anchors)
    return False


def _has_anchor(items: Any) -> bool:
    for op, arg in items:
        if op is sre_constants.AT:
            return True
        if any(_has_anchor(child) for child in children(op, arg)):
            return True
    return False


def rewrite_lookarounds(node: dict[str, Any]) -> None:
    """Rewrites, in place, a `pattern` of `node` in one of the idioms above; leaves any other
    pattern as it is."""
    pattern = node.get("pattern")
    if not isinstance(pattern, str) or "(?" not in pattern:
        return
    written = _contains(pattern) or _ends(pattern)
    if written is not None:
        node["pattern"] = written


def _contains(pattern: str) -> str | None:
    match = _CONTAINS.match(pattern)
    if match is None:
        return None
    atoms = _LOOKAHEAD_ATOM.findall(match.group(1))
    if not 1 <= len(atoms) <= _MAX_CLASSES:
        return None
    orders = [".*" + ".*".join(order) + ".*" for order in itertools.permutations(atoms)]
    return "^(?:" + "|".join(dict.fromkeys(orders)) + ")$"


def _ends(pattern: str) -> str | None:
    match = _ENDS.match(pattern)
    if match is None:
        return None
    first, cls, count, last = match.groups()
    if first is None and last is None:
        return None
    low, high = _count(count)
    head = _without(cls, [first]) if first else cls
    tail = _without(cls, [last]) if last else cls
    both = _without(cls, [c for c in (first, last) if c])
    if head is None or tail is None or both is None:
        return None
    if first and last:
        # One character is both the first and the last; two or more have distinct ends.
        ways = []
        if low <= 1 <= high:
            ways.append(both)
        if high >= 2:
            ways.append(head + _repeat(cls, max(low - 2, 0), high - 2) + tail)
        if not ways:
            return None
        # The empty string too when the count allows it (an optional group, not an empty
        # alternative, which not every regex engine takes).
        return "^(?:" + "|".join(ways) + ")" + ("?" if low == 0 else "") + "$"
    edge = head if first else tail
    if high < 1:
        return "^$"
    rest = _repeat(cls, max(low - 1, 0), high - 1)
    body = edge + rest if first else rest + edge
    return "^(?:" + body + ")" + ("?" if low == 0 else "") + "$"


def _count(count: str) -> tuple[int, float]:
    """(min, max) repetitions of a quantifier `+`, `*` or `{m,n}`."""
    if count == "+":
        return 1, float("inf")
    if count == "*":
        return 0, float("inf")
    low, comma, high = count[1:-1].partition(",")
    if not comma:
        return int(low), int(low)
    return int(low), float("inf") if not high else int(high)


def _repeat(cls: str, low: int, high: float) -> str:
    if high == float("inf"):
        return f"{cls}{{{low},}}"
    return f"{cls}{{{low},{int(high)}}}"


def _literal(atom: str) -> str | None:
    """The one character a plain or escaped-punctuation atom stands for, else None."""
    if len(atom) == 1:
        return atom
    if len(atom) == 2 and atom[0] == "\\" and not atom[1].isalnum():
        return atom[1]
    return None


def _without(cls: str, atoms: list[str]) -> str | None:
    """The bracket class `cls` without the characters `atoms` stand for, when each appears
    in it as a single item (not inside a range or a class escape); else None."""
    if cls.startswith("[^"):
        return None
    chars = [_literal(a) for a in atoms]
    if any(c is None for c in chars):
        return None
    items = re.findall(r"\\.|.-(?!\])[^\]]|.", cls[1:-1])
    kept = []
    for item in items:
        if len(item) == 1 and item in chars:
            continue
        if len(item) == 2 and item[0] == "\\" and not item[1].isalnum() and item[1] in chars:
            continue
        if len(item) == 2 and item[0] == "\\":  # \d, \w...: may hold an excluded character
            if any(re.fullmatch(item, c) for c in chars):
                return None
        elif len(item) == 3 and any(item[0] <= c <= item[2] for c in chars):
            return None
        kept.append(item)
    if not kept:
        return None
    return "[" + "".join(kept) + "]"
