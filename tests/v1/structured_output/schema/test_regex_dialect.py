"""Regex text for automaton backends: ASCII classes, anchors, choices, backreferences."""

from __future__ import annotations

import re

import pytest

from vllm.v1.structured_output.schema.regex_dialect import (
    ascii_classes,
    choice_regex,
    find_backreference,
    strip_anchors,
)


@pytest.mark.parametrize("regex,expected", [
    (r"\d{3}", "[0-9]{3}"),
    (r"[\d.]+", "[0-9.]+"),
    (r"\w+@\w+", "[0-9A-Za-z_]+@[0-9A-Za-z_]+"),
    (r"\\d", r"\\d"),  # a literal backslash, then d
    (r"[]\d]", "[]0-9]"),
    (r"[^]\w]", "[^]0-9A-Za-z_]"),
    (r"\D\W\s", r"\D\W\s"),
])
def test_ascii_classes(regex: str, expected: str) -> None:
    assert ascii_classes(regex) == expected
    for text in ("123", "a_1", "é", "٤"):
        assert bool(re.fullmatch(expected, text)) == bool(
            re.fullmatch(regex, text, flags=re.ASCII)), text


def test_strip_anchors() -> None:
    assert strip_anchors("^ab$") == "ab"
    assert strip_anchors(r"ab\$") == r"ab\$"
    assert strip_anchors(r"ab\\$") == r"ab\\"
    assert strip_anchors("a|b") == "a|b"


def test_choice_regex_matches_exactly_the_choices() -> None:
    choices = ["a|b", "(x)", "[a-z]", ".*", 'say "hi"', "back\\slash", "a\nb", "", "{1}", "-~&#"]
    regex = choice_regex(choices)
    for choice in choices:
        assert re.fullmatch(regex, choice), choice
    for other in ["a", "x", "q", "abc", "back\\\\slash", "1"]:
        assert not re.fullmatch(regex, other), other


def test_find_backreference() -> None:
    assert find_backreference(r"(a)\1") == "\\1"
    assert find_backreference(r"(?P<x>a)(?P=x)") == "(?P="
    assert find_backreference(r"(?<x>a)\k<x>") == "\\k"
    assert find_backreference(r"\\1 \d") is None
