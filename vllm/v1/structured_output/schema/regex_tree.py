"""Walking Python's parse of a regex (`re._parser`): the sub-patterns an item holds, shared by
the pattern checks of the structured-output backends (docs/architecture.md section 5), and
the strings of a pattern that matches only a few (`finite_language`).

Pure Python.
"""

from __future__ import annotations

import re
import re._constants as sre_constants
import re._parser as sre_parse
from typing import Any

_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT,
            sre_constants.POSSESSIVE_REPEAT)


def children(op: Any, arg: Any) -> list[Any]:
    """The sub-patterns of one parsed item (a group's, a repeat's, each alternative of a
    branch, a lookaround's, an atomic group's, a conditional's); [] for a leaf."""
    if op is sre_constants.SUBPATTERN:
        return [arg[-1]]
    if op in _REPEATS:
        return [arg[2]]
    if op is sre_constants.BRANCH:
        return list(arg[1])
    if op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT):
        return [arg[1]]
    if op is sre_constants.ATOMIC_GROUP:
        return [arg]
    if op is sre_constants.GROUPREF_EXISTS:
        return [a for a in arg[1:] if a is not None]
    return []


def plain_children(op: Any, arg: Any) -> list[Any] | None:
    """The sub-patterns of a group, a repeat or an alternation, which match what their parts
    match; None for any other item (a leaf, or a lookaround, atomic group or conditional,
    which a check of the characters a pattern can match does not read through)."""
    if op is sre_constants.SUBPATTERN or op in _REPEATS or op is sre_constants.BRANCH:
        return children(op, arg)
    return None


def finite_language(regex: str, limit: int = 64) -> list[str] | None:
    """The strings an anchored `regex` (`^...$`) matches, when they are at most `limit`
    (literals, classes, alternations, groups and fixed repeats); None otherwise (an
    unanchored or unbounded pattern, flags, anything else). JSON Schema's `$` is the end
    of the string, so a trailing newline is not a match here either."""
    try:
        parsed = list(sre_parse.parse(regex))
    except (re.error, RecursionError):
        return None
    if (len(parsed) < 2 or parsed[0] != (sre_constants.AT, sre_constants.AT_BEGINNING)
            or parsed[-1] != (sre_constants.AT, sre_constants.AT_END)):
        return None
    return _strings(parsed[1:-1], limit)


def _strings(items: Any, limit: int) -> list[str] | None:
    out = [""]
    for op, arg in items:
        if op is sre_constants.LITERAL:
            parts = [chr(arg)]
        elif op is sre_constants.IN:
            parts = _class(arg, limit)
        elif op is sre_constants.SUBPATTERN and not arg[1] and not arg[2]:
            parts = _strings(arg[3], limit)
        elif op is sre_constants.BRANCH:
            found = [_strings(b, limit) for b in arg[1]]
            parts = None if None in found else [s for f in found for s in f]  # type: ignore
        elif op is sre_constants.MAX_REPEAT and arg[0] == arg[1] <= limit:
            parts = [""]
            for _ in range(arg[0]):
                one = _strings(arg[2], limit)
                parts = None if one is None else [p + s for p in parts for s in one]
                if parts is None or len(parts) > limit:
                    return None
        else:
            return None
        if parts is None:
            return None
        out = [o + p for o in out for p in parts]
        if len(out) > limit:
            return None
    return list(dict.fromkeys(out))


def _class(items: Any, limit: int) -> list[str] | None:
    """The characters of a positive class of literals and ranges (None: negated, a
    category, or more than `limit`)."""
    chars: list[str] = []
    for op, arg in items:
        if op is sre_constants.LITERAL:
            chars.append(chr(arg))
        elif op is sre_constants.RANGE and arg[1] - arg[0] < limit:
            chars.extend(chr(c) for c in range(arg[0], arg[1] + 1))
        else:
            return None
        if len(chars) > limit:
            return None
    return chars
