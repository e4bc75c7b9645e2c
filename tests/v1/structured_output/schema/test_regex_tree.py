"""Tests of the parsed-regex walk shared by the pattern checks (regex_tree.py)."""

from __future__ import annotations

import re._parser as sre_parse

import pytest

from vllm.v1.structured_output.schema.regex_tree import children, plain_children


@pytest.mark.parametrize("pattern, count, plain", [
    ("(ab)", 1, True), ("a*", 1, True), ("a+?", 1, True), ("a|bc", 2, True),
    ("(?=a)", 1, False), ("(?!a)", 1, False), ("(?>a)", 1, False), ("(a)(?(1)b|c)", 2, False),
    ("a", 0, False), ("[ab]", 0, False),
])
def test_children_of_the_last_item(pattern: str, count: int, plain: bool) -> None:
    op, arg = list(sre_parse.parse(pattern))[-1]
    assert len(children(op, arg)) == count
    parts = plain_children(op, arg)
    assert (parts is not None) == plain
    if plain:
        assert parts == children(op, arg)
