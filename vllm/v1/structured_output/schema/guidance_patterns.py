"""JSON-schema patterns llguidance would not enforce exactly.

llguidance matches a string's `pattern` against the decoded characters, except in one case:
a negated class that excludes `"` or `\\` (`[^"]`, `[^\\\\/]`) still lets the escaped form
(`\\"`, `\\\\`) through, so `{"pattern": "^[^\\"]+$"}` would accept the string `a"b`. Positive
classes, `.` and other negated classes are exact. The llguidance backend refuses such a
schema, so `auto` tries the next backend and the request never gets an invalid output.
"""

from __future__ import annotations

import re
import re._constants as sre_constants
import re._parser as sre_parse
from typing import Any

from vllm.v1.structured_output.schema.regex_tree import children

_ESCAPED = (ord('"'), ord("\\"))


def find_escape_blind_pattern(schema: Any, path: str = "#") -> str | None:
    """The JSON pointer of the first `pattern` (or `patternProperties`) in `schema` with a
    negated class that excludes `"` or a backslash; None when there is none. Patterns
    Python cannot parse are left to the backend to judge."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            if (found := find_escape_blind_pattern(item, f"{path}/{i}")) is not None:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    if isinstance(schema.get("pattern"), str) and _is_escape_blind(schema["pattern"]):
        return f"{path}/pattern"
    names = schema.get("patternProperties")
    if isinstance(names, dict) and any(_is_escape_blind(n) for n in names if isinstance(n, str)):
        return f"{path}/patternProperties"
    for key, value in schema.items():
        # Under these keys the values are names (or data), not schemas.
        if key in ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas"):
            if isinstance(value, dict):
                for name, sub in value.items():
                    if (found := find_escape_blind_pattern(sub, f"{path}/{key}/{name}")):
                        return found
        elif key not in ("enum", "const", "default", "examples", "pattern"):
            if (found := find_escape_blind_pattern(value, f"{path}/{key}")) is not None:
                return found
    return None


def _is_escape_blind(pattern: str) -> bool:
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return False
    return _has_blind_class(parsed)


def _has_blind_class(items: Any) -> bool:
    for op, arg in items:
        if op is sre_constants.NOT_LITERAL and arg in _ESCAPED:
            return True
        if op is sre_constants.IN and arg and arg[0][0] is sre_constants.NEGATE:
            if any(_excludes(code) for code in arg[1:]):
                return True
        for sub in children(op, arg):
            if _has_blind_class(sub):
                return True
    return False


def _excludes(code: tuple[Any, Any]) -> bool:
    """True when one member of a negated class is `"` or a backslash."""
    op, arg = code
    if op is sre_constants.LITERAL:
        return arg in _ESCAPED
    if op is sre_constants.RANGE:
        return any(arg[0] <= c <= arg[1] for c in _ESCAPED)
    if op is sre_constants.CATEGORY:
        # \W and \S include both; \D includes both too.
        return arg in (sre_constants.CATEGORY_NOT_WORD, sre_constants.CATEGORY_NOT_SPACE,
                       sre_constants.CATEGORY_NOT_DIGIT)
    return False
