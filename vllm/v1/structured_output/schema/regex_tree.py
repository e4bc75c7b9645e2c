"""Walking Python's parse of a regex (`re._parser`): the sub-patterns an item holds, shared by
the pattern checks of the structured-output backends (docs/architecture.md section 5).

Pure Python.
"""

from __future__ import annotations

import re._constants as sre_constants
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
