"""String length bounds folded into the one keyword xgrammar enforces beside them
(docs/architecture.md section 5): xgrammar 0.2.9 takes `pattern` or `format`, but not either
together with `minLength`/`maxLength`, so `fold_lengths` rewrites such strings for it:

- a pattern that is a run of one-character atoms (`^[a-z][a-z0-9-]*$`, `^[^<>:"|?*]+$`) takes
  the bounds into its counts (`^[a-z][a-z0-9-]{0,62}$`): exact with one variable count,
  stricter (each count gets a share of the bounds) with several;
- a `format` whose strings are never empty drops a `minLength` of 1; a fixed-length format
  (`date`, `uuid`) drops bounds that allow its length (both exact);
- `uri-reference` and `hostname` with bounds become a pattern of a character class that
  spells only valid values (a relative path of unreserved characters and sub-delimiters; a
  single DNS label) with the bounds as its count: stricter.

The rewritten schema is read with the backends' `$` (the end of the string); Python's `$`
also matches before a final newline, which the grammar never produces here. Anything else
stays, for `check_xgrammar_support` to refuse.

Pure Python.
"""

from __future__ import annotations

import re
from typing import Any

from vllm.v1.structured_output.schema.facts import subschemas

# Formats whose xgrammar grammar never yields the empty string (measured on 0.2.9).
_NON_EMPTY_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
    "uuid", "relative-json-pointer",
})
_FIXED_LENGTH_FORMATS = {"date": 10, "uuid": 36}
# Formats written as a class of characters that only ever spells a valid value, and the
# longest run that stays valid: RFC 3986's relative path of unreserved characters and
# sub-delimiters (no ':', '@', '?', '#' or '%', which would need structure), and one DNS
# label of at most 63 letters and digits (RFC 1123).
_FORMAT_CLASSES = {
    # ')' last: check_xgrammar_support's crude scan reads ")*" as a repeated group.
    "uri-reference": ("[A-Za-z0-9._~!$&'*+,;=/()-]", None),
    "hostname": ("[a-z0-9]", 63),
    # RFC 6570's literal characters, without '%' (pct-encoding needs structure) and the
    # characters of expressions.
    "uri-template": ("[A-Za-z0-9._~!$&*+,;=/:?@#()-]", None),
}
_QUANTIFIER = re.compile(r"\*|\+|\?|\{(\d+)\}|\{(\d+),(\d*)\}")
_MAX_COUNT = 100_000
# The largest count a folded atom gets: xgrammar unrolls a counted repeat, and its compile
# time grows with the count (a path's `maxLength: 4096` took 90 s; 256 takes well under one).
# A larger bound is capped here, which narrows the strings, never widening them.
MAX_FOLDED_COUNT = 256


def fold_lengths(schema: Any) -> None:
    """Rewrites, in place and in every subschema, strings whose `pattern` or `format` sits
    beside `minLength`/`maxLength` as described in the module docstring."""
    if not isinstance(schema, dict):
        return
    _fold(schema)
    for sub, _ in subschemas(schema, "#"):
        fold_lengths(sub)


def _bound(node: dict[str, Any], key: str) -> int | None:
    value = node.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        return None
    return int(value)


def _fold(node: dict[str, Any]) -> None:
    if "minLength" not in node and "maxLength" not in node:
        return
    low, high = _bound(node, "minLength"), _bound(node, "maxLength")
    if low is None and "minLength" in node or high is None and "maxLength" in node:
        return  # a bound that is not a whole number: left for the check to refuse
    low = low or 0
    if isinstance(node.get("pattern"), str):
        written = bounded_pattern(node["pattern"], low, high)
        if written is not None:
            node["pattern"] = written
            _drop_lengths(node)
        return
    fmt = node.get("format")
    if not isinstance(fmt, str):
        return
    fixed = _FIXED_LENGTH_FORMATS.get(fmt)
    if fixed is not None and low <= fixed and (high is None or fixed <= high):
        _drop_lengths(node)
    elif high is None and low <= 1 and fmt in _NON_EMPTY_FORMATS:
        _drop_lengths(node)
    elif fmt in _FORMAT_CLASSES:
        cls, longest = _FORMAT_CLASSES[fmt]
        if longest is not None:
            high = longest if high is None else min(high, longest)
        if high is not None:
            high = min(high, MAX_FOLDED_COUNT)  # narrower (see MAX_FOLDED_COUNT)
        if fmt == "hostname":
            low = max(low, 1)
        if high is not None and low > high:
            return
        node["pattern"] = "^" + cls + _count(low, high) + "$"
        del node["format"]
        _drop_lengths(node)


def spell_formats(schema: Any, formats: frozenset[str]) -> None:
    """Rewrites, in place and in every subschema, a string `format` among `formats` (with no
    `pattern` beside it) as the pattern of its class above, which a backend lacking the
    format enforces: stricter, never wrong. Length bounds stay beside it."""
    if not isinstance(schema, dict):
        return
    fmt = schema.get("format")
    if fmt in formats and fmt in _FORMAT_CLASSES and "pattern" not in schema:
        cls, longest = _FORMAT_CLASSES[fmt]
        schema["pattern"] = "^" + cls + ("+" if fmt == "hostname" else "*") + "$"
        if longest is not None:
            high = _bound(schema, "maxLength")
            schema["maxLength"] = longest if high is None else min(high, longest)
        del schema["format"]
    for sub, _ in subschemas(schema, "#"):
        spell_formats(sub, formats)


def _drop_lengths(node: dict[str, Any]) -> None:
    node.pop("minLength", None)
    node.pop("maxLength", None)


def _count(low: int, high: int | None) -> str:
    if high is None:
        return "{%d,}" % low
    return "{%d}" % low if low == high else "{%d,%d}" % (low, high)


def bounded_pattern(pattern: str, low: int, high: int | None) -> str | None:
    """`pattern` (anchored at both ends, a sequence of one-character atoms each with an
    optional quantifier) with its counts narrowed so every match has between `low` and
    `high` characters, or None when the pattern has another shape or no count fits.

    Exact when at most one atom has a variable count and no count passes MAX_FOLDED_COUNT;
    otherwise each variable atom gets a share of the room, and counts are capped, which
    narrows the strings (never widening them)."""
    atoms = _atoms(pattern)
    if atoms is None:
        return None
    fixed = sum(a for _, a, b in atoms if a == b)
    variable = [i for i, (_, a, b) in enumerate(atoms) if a != b]
    counts = [[a, b] for _, a, b in atoms]
    if not variable:
        return pattern if low <= fixed and (high is None or fixed <= high) else None
    least = sum(a for _, a, _ in atoms)
    # Raise the minimum counts, in order, until the shortest match is long enough.
    deficit = max(0, low - least)
    for i in variable:
        room = deficit if counts[i][1] is None else min(deficit, counts[i][1] - counts[i][0])
        counts[i][0] += room
        deficit -= room
    if deficit:
        return None
    if high is not None:
        spare = high - sum(c[0] for c in counts)
        if spare < 0:
            return None
        if len(variable) == 1:
            i = variable[0]
            counts[i][1] = counts[i][0] + spare if counts[i][1] is None else \
                min(counts[i][1], counts[i][0] + spare)
        else:
            share, extra = divmod(spare, len(variable))
            for n, i in enumerate(variable):
                room = share + (1 if n < extra else 0)
                top = counts[i][0] + room
                counts[i][1] = top if counts[i][1] is None else min(counts[i][1], top)
    for count in counts:
        if count[0] > MAX_FOLDED_COUNT:
            return None
        if high is not None and (count[1] is None or count[1] > MAX_FOLDED_COUNT):
            count[1] = MAX_FOLDED_COUNT
    return "^" + "".join(atom + _count(a, b) for (atom, _, _), (a, b) in
                         zip(atoms, counts)) + "$"


def _atoms(pattern: str) -> list[tuple[str, int, int | None]] | None:
    """The atoms of `^atom{a,b}...$` with their counts, or None for any other shape."""
    if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$" or pattern[-2] == "\\":
        return None
    body, i, out = pattern[1:-1], 0, []
    while i < len(body):
        end = _atom_end(body, i)
        if end is None:
            return None
        atom, i = body[i:end], end
        low, high = 1, 1
        match = _QUANTIFIER.match(body, i)
        if match is not None:
            q = match.group(0)
            if q in "*+?":
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[q]
            elif match.group(1) is not None:
                low = high = int(match.group(1))
            else:
                low = int(match.group(2))
                high = int(match.group(3)) if match.group(3) else None
            i = match.end()
            if body[i:i + 1] in ("?", "+"):
                return None  # a lazy or possessive quantifier
        if low > _MAX_COUNT or (high is not None and (high < low or high > _MAX_COUNT)):
            return None
        out.append((atom, low, high))
    try:
        re.compile(pattern)
    except re.error:
        return None
    return out


def _atom_end(body: str, i: int) -> int | None:
    """Where the one-character atom at `body[i]` ends, or None when it is not one."""
    c = body[i]
    if c == "[":
        j = i + 1
        if body[j:j + 1] == "^":
            j += 1
        if body[j:j + 1] == "]":
            j += 1  # a leading ']' is a literal
        while j < len(body) and body[j] != "]":
            if body[j] == "[":
                return None  # a nested class or a POSIX name: some dialects differ
            j += 2 if body[j] == "\\" else 1
        return j + 1 if j < len(body) else None
    if c == "\\":
        nxt = body[i + 1:i + 2]
        if nxt == "u":
            return i + 6 if re.fullmatch(r"[0-9A-Fa-f]{4}", body[i + 2:i + 6]) else None
        if nxt == "x":
            return i + 4 if re.fullmatch(r"[0-9A-Fa-f]{2}", body[i + 2:i + 4]) else None
        # Anchors, back-references and property classes are not one character.
        if not nxt or nxt.isdigit() or nxt in "bBAZzpPkGQE":
            return None
        return i + 2
    if c in "()|*+?{}^$":
        return None
    return i + 1
