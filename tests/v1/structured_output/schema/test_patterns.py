"""Tests of the lookaround idioms written without lookarounds (schema_patterns.py): on many
strings, the rewritten pattern matches exactly where the original does (Python's `re`, which
`jsonschema` uses)."""

from __future__ import annotations

import random
import re

import pytest

from vllm.v1.structured_output.schema.normalize import check_xgrammar_support, normalize_json_schema
from vllm.v1.structured_output.schema.patterns import rewrite_lookarounds

# Characters each idiom tells apart, a newline (which `.` does not match) included.
_ALPHABET = "aZ0-.b_\n"


def _strings() -> list[str]:
    rng = random.Random(0)
    return [""] + ["".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 9)))
                   for _ in range(4000)]


@pytest.mark.parametrize(
    "pattern",
    [
        r"^(?=.*[a-z])(?=.*[A-Z])(?=.*[0-9]).+$",
        r"^(?=.*\d)(?=.*[._-]).*$",
        r"^(?!-)[a-z0-9-]{1,63}(?<!-)$",
        r"^(?!-)[a-z0-9-]+$",
        r"^[a-z0-9-]*(?<!-)$",
        r"^(?!\.)[a-z.]{0,5}(?<!\.)$",
        r"^(?!_)[a-zA-Z0-9_]{2,}(?<!_)$",
    ],
    ids=["password", "digit_and_punctuation", "dns_label", "no_leading", "no_trailing",
         "escaped_dot", "at_least_two"],
)
def test_lookaround_idioms_are_rewritten_exactly(pattern: str) -> None:
    node = {"type": "string", "pattern": pattern}
    rewrite_lookarounds(node)
    written = node["pattern"]
    assert "(?=" not in written and "(?!" not in written and "(?<" not in written
    for text in _strings():
        assert bool(re.search(written, text)) == bool(re.search(pattern, text)), text


@pytest.mark.parametrize(
    "pattern",
    [
        r"^(?=a)b$",                       # a lookahead that is not "contains"
        r"^(?=.*\d).{8,}$",                # a counted body
        r"^(?!a)[^-]{1,3}$",               # a negated class
        r"^(?!e)[a-z]{1,3}$",              # the character is inside a range
        r"(?=.*[a-z])(?=.*[0-9]).+$",      # not anchored
    ],
)
def test_other_lookarounds_stay(pattern: str) -> None:
    node = {"pattern": pattern}
    rewrite_lookarounds(node)
    assert node["pattern"] == pattern


def test_a_range_holding_the_character_keeps_the_pattern() -> None:
    node = {"pattern": r"^(?!a)[a-z]{1,3}(?<!b)$"}
    rewrite_lookarounds(node)
    assert node["pattern"] == r"^(?!a)[a-z]{1,3}(?<!b)$"


def test_a_dns_label_goes_to_xgrammar() -> None:
    out = normalize_json_schema({"type": "string", "pattern": r"^(?!-)[a-z0-9-]{1,63}(?<!-)$"})
    check_xgrammar_support(out)
