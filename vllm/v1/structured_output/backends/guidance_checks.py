"""What the llguidance backend refuses before compiling (Lark features that break the
engine's guarantees, patterns and numbers it would not enforce exactly) and how its compile
errors read: llguidance's messages mapped to the error the client gets, naming the field."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction
from typing import Any

from vllm.exceptions import GrammarCompileError, UnsupportedConstraintError
from vllm.v1.structured_output.schema.facts import (
    drop_fraction_branches,
    is_number,
    subschemas,
)
from vllm.v1.structured_output.schema.guidance_patterns import find_escape_blind_pattern

# The longest error message a client gets.
_MAX_MESSAGE = 500
# llguidance error messages that mean "well formed, but this backend cannot enforce it".
_UNIMPLEMENTED_KEYS = re.compile(r"Unimplemented keys: \[([^\]]*)\]")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
_UNSUPPORTED_PHRASES = (
    "not supported",
    "unsupported",
    "only supported",
    "not implemented",
)
# "1(6): ..." / "at 1(8): ...": line and column of a Lark or regex error.
_POSITION = re.compile(r"^(?:at )?(\d+)\((\d+)\):\s*")
# Lark features of llguidance that break the engine's guarantees (see check_lark).
_RULE_ATTRIBUTES = re.compile(r"\[[^\]\n]*\b(stop|max_tokens)\s*=")
_LLGUIDANCE_OPTIONS = re.compile(r"%llguidance\s*\{\s*[^}\s]")


def first_line(text: str) -> str:
    """The first non-blank line of an error message."""
    return text.strip().split("\n", 1)[0].strip()


def clean_error(message: str) -> str:
    """llguidance's messages carry positions, source excerpts and state dumps; users need
    the cause."""
    message = message.split("<state>", 1)[0].strip()
    if "regex parse error" in message:
        lines = [line.strip() for line in message.split("\n")]
        after = lines[lines.index(next(l for l in lines if "regex parse error" in l)) + 1:]
        regex = after[0] if after else ""
        cause = next((l[len("error:"):].strip() for l in lines if l.startswith("error:")), "")
        message = f"regex {regex!r}: {cause}" if cause else first_line(message)
    else:
        message = first_line(message)
        position = _POSITION.match(message)
        if position:
            line, column = position.groups()
            message = f"line {line}, column {column}: {message[position.end():]}"
    return message[:_MAX_MESSAGE] or "compile error"


def _is_unsupported(message: str) -> bool:
    lowered = message.lower()
    return any(phrase in lowered for phrase in _UNSUPPORTED_PHRASES) or bool(
        _UNIMPLEMENTED_KEYS.search(message) or _UNKNOWN_FORMAT.search(message)
    )


def compile_error(kind: str, message: str) -> GrammarCompileError:
    """Maps one llguidance error message to the exception the client gets."""
    param = f"structured_outputs.{kind}"
    keys = _UNIMPLEMENTED_KEYS.search(message)
    if keys:
        names = [repr(k.strip().strip('"')) for k in keys.group(1).split(",")]
        noun = "keyword" if len(names) == 1 else "keywords"
        return UnsupportedConstraintError(
            param,
            f"schema {noun} {', '.join(names)} cannot be enforced (unsupported by llguidance)",
        )
    fmt = _UNKNOWN_FORMAT.search(message)
    if fmt:
        return UnsupportedConstraintError(
            param, f"string format {fmt.group(1)!r} (unsupported by llguidance)"
        )
    if "oneOf constraints are not supported" in message:
        return UnsupportedConstraintError(
            param,
            "'oneOf' whose branches may overlap (unsupported by llguidance; "
            "one_of_as_any_of enforces it as anyOf)",
        )
    cleaned = clean_error(message)
    if _is_unsupported(message):
        return UnsupportedConstraintError(param, f"{cleaned} (unsupported by llguidance)")
    if kind == "grammar":
        # Upstream vLLM's wording for a grammar that does not parse, then the cause.
        cleaned = f"Failed to convert the grammar: {cleaned}"
    return GrammarCompileError(param, cleaned)


def refuse_escape_blind_patterns(schema: dict[str, Any], param: str) -> None:
    """Raises UnsupportedConstraintError for a pattern llguidance would not enforce exactly
    (guidance_patterns.py), naming where it is."""
    where = find_escape_blind_pattern(schema)
    if where is not None:
        raise UnsupportedConstraintError(
            param, f"the pattern at {where} negates a class holding '\"' or a backslash, "
            "which llguidance does not enforce on escaped characters")


def refuse_fractions(schema: Any, param: str) -> None:
    """Drops `anyOf` branches of numbers that are not integers where another branch remains
    (narrower); raises UnsupportedConstraintError naming the place of one that stays."""
    where = drop_fraction_branches(schema)
    if where is not None:
        raise UnsupportedConstraintError(
            param, f"at {where}: a number that is not an integer (a 'oneOf' of 'integer' and "
            "'number', or 'not' of 'integer') has no llguidance schema")


def _skip_literals(text: str) -> str:
    """Returns Lark `text` without comments and string/regex literals (replaced by spaces),
    so that feature checks do not match inside them."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        if c in "\"/":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(" ")
            i = j + 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def check_lark(text: str) -> None:
    """Refuses llguidance-only Lark features that would break the engine's guarantees."""
    code = _skip_literals(text)
    param = "structured_outputs.grammar"
    if "<[" in code:
        raise UnsupportedConstraintError(
            param, "token-id references <[...]> (unsupported by llguidance in this engine)"
        )
    if _LLGUIDANCE_OPTIONS.search(code):
        raise UnsupportedConstraintError(
            param, "%llguidance options (unsupported by llguidance in this engine)"
        )
    attribute = _RULE_ATTRIBUTES.search(code)
    if attribute:
        raise UnsupportedConstraintError(
            param,
            f"rule attribute {attribute.group(1)}= (unsupported by llguidance in this engine: "
            "it prevents rollback)",
        )


def refuse_open_bound(schema: Any, param: str, path: str = "#") -> None:
    """Rewrites, in place, the bounds beside a fractional `multipleOf` onto its multiples,
    then raises UnsupportedConstraintError at a number whose bounds llguidance 1.9.1 gets
    wrong (each found by the differential check):

    - an `exclusiveMinimum` that is a whole k with an upper bound below k + 1 admits k (`0`
      passed `exclusiveMinimum: 0, maximum: 0.5`); mirrored, an `exclusiveMaximum` that is
      a whole k with a lower bound above k - 1 (`-2` passed `minimum: -2.9,
      exclusiveMaximum: -2`). With a wider range it refuses k, as it should;
    - a fractional `multipleOf` beside a bound refuses valid values unless the divisor has
      one decimal or is a power of ten (0.01) and the bounds are inclusive multiples of it
      (`-0.50` failed `multipleOf: 0.25, minimum: -2.5`; `0.10` failed `multipleOf: 0.05,
      exclusiveMinimum: 0`; `2.6` failed `multipleOf: 0.1, maximum: 2.69`). The rewrite
      makes every bound an inclusive multiple (exact: `maximum: 2.69` is `maximum: 2.6`
      for multiples of 0.1, `exclusiveMinimum: 0` is `minimum: 0.01` for multiples of
      0.01), so only other divisors are refused.
    """
    if isinstance(schema, dict):
        _align_bounds(schema)
        _check_bounds(schema, param, path)
        for sub, sub_path in subschemas(schema, path):
            refuse_open_bound(sub, param, sub_path)


def _exact(x: Any) -> Fraction:
    return Fraction(Decimal(repr(x)))


def _align_bounds(node: dict[str, Any]) -> None:
    """Each bound beside a fractional `multipleOf` m becomes the inclusive bound on the
    nearest multiple of m inside it (the same numbers are multiples of m either way)."""
    step = node.get("multipleOf")
    if not is_number(step) or float(step).is_integer() or step <= 0:
        return
    unit = _exact(step)
    for key, floor, shift in (("minimum", False, 0), ("exclusiveMinimum", False, 1),
                              ("maximum", True, 0), ("exclusiveMaximum", True, -1)):
        bound = node.get(key)
        if not is_number(bound) or not math.isfinite(bound):
            continue
        ratio = _exact(bound) / unit
        if ratio.denominator == 1:
            k = int(ratio) + shift
        else:  # not a multiple: the same whether or not it is exclusive
            k = math.floor(ratio) + (0 if floor else 1)
        del node[key]
        inclusive = "minimum" if "inim" in key else "maximum"
        value = float(Decimal(k) * Decimal(repr(step)))
        old = node.get(inclusive)
        if old is None or (value > old if inclusive == "minimum" else value < old):
            node[inclusive] = value


def _decimals(x: Any) -> int:
    """How many digits `x` has after its decimal point, written shortest."""
    text = repr(float(x))
    if "e" in text:
        return 99  # far from the range these checks are about: counted as too many
    return len(text.split(".")[1].rstrip("0"))


def _check_bounds(node: dict[str, Any], param: str, path: str) -> None:
    if node.get("type") == "integer":
        return
    low, high = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
    lows = [node[k] for k in ("minimum", "exclusiveMinimum") if is_number(node.get(k))]
    highs = [node[k] for k in ("maximum", "exclusiveMaximum") if is_number(node.get(k))]
    if is_number(low) and float(low).is_integer() and any(h < low + 1 for h in highs):
        raise UnsupportedConstraintError(
            param, f"at {path}: 'exclusiveMinimum' {low} with a maximum below {low + 1} "
            f"admits {low} (unsupported by llguidance)")
    if is_number(high) and float(high).is_integer() and any(b > high - 1 for b in lows):
        raise UnsupportedConstraintError(
            param, f"at {path}: 'exclusiveMaximum' {high} with a minimum above {high - 1} "
            f"admits {high} (unsupported by llguidance)")
    step = node.get("multipleOf")
    if not is_number(step) or float(step).is_integer() or not (lows or highs):
        return
    digits = _decimals(step)
    power_of_ten = _exact(step) == Fraction(1, 10**digits)
    if (digits >= 2 and not power_of_ten) or any(_decimals(b) > digits for b in lows + highs):
        raise UnsupportedConstraintError(
            param, f"at {path}: 'multipleOf' {step} beside a bound refuses valid values "
            "(unsupported by llguidance; a divisor of one decimal or a power of ten, "
            "like 0.5 or 0.01, is)")
