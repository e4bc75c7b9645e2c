"""Regex text for automaton backends (outlines): the engine's regex meaning in their dialect.

- `ascii_classes`: `\\d` and `\\w` mean ASCII digits and word characters in this engine
  (as in xgrammar and JSON-schema patterns); Rust's regex crate reads them as Unicode classes,
  whose automata are also much larger (a `\\d{3}` index over 150k tokens: one second).
- `strip_anchors`: the whole output must match, so a leading `^` and a trailing `$` say
  nothing; the outlines index refuses anchors.
- `choice_regex`: a regex whose language is exactly the given strings.
- `find_backreference`: backreferences are not regular; no automaton can enforce them.

Pure Python; imports no backend library.
"""

from __future__ import annotations

from collections.abc import Sequence

# Characters that are operators somewhere in Rust's regex syntax; escaping any of them is
# allowed there, so a choice is always matched as text.
_META = frozenset("\\.+*?()|[]{}^$#&-~")

_ASCII = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(regex: str) -> str:
    """Returns `regex` with every `\\d` and `\\w` (inside classes too) spelled as ASCII."""
    out: list[str] = []
    depth = 0  # nesting of character classes (Rust allows `[a[b]]`)
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\" and i + 1 < n:
            name = regex[i + 1]
            if name in _ASCII:
                out.append(_ASCII[name] if depth else f"[{_ASCII[name]}]")
            else:
                out.append(regex[i : i + 2])
            i += 2
            continue
        if c == "[":
            out.append(c)
            depth += 1
            i += 1
            # `[^]...]` and `[]...]`: a `]` first in a class is a member.
            if regex.startswith("^", i):
                out.append("^")
                i += 1
            if regex.startswith("]", i):
                out.append("]")
                i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


def strip_anchors(regex: str) -> str:
    """Drops a leading `^` and an unescaped trailing `$` (no-ops for a whole-output match)."""
    if regex.startswith("^"):
        regex = regex[1:]
    if regex.endswith("$"):
        # Escaped when an odd number of backslashes precede it.
        backslashes = len(regex) - 1 - len(regex[:-1].rstrip("\\"))
        if backslashes % 2 == 0:
            regex = regex[:-1]
    return regex


def escape(text: str) -> str:
    """`text` as a regex matching exactly it."""
    return "".join("\\" + c if c in _META else c for c in text)


def choice_regex(choices: Sequence[str]) -> str:
    """A regex whose language is exactly the strings in `choices`."""
    return "(?:" + "|".join(escape(c) for c in choices) + ")"


def find_backreference(regex: str) -> str | None:
    """Returns the first backreference (`\\1`..`\\9`, `\\k<name>`, `(?P=name)`) in `regex`."""
    i, n = 0, len(regex)
    while i < n:
        if regex[i] == "\\" and i + 1 < n:
            nxt = regex[i + 1]
            if nxt in "123456789" or (nxt == "k" and regex.startswith("<", i + 2)):
                return regex[i : i + 2]
            i += 2
            continue
        if regex.startswith("(?P=", i):
            return "(?P="
        i += 1
    return None
