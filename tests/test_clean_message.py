"""clean_message: what a client may see of an error is one line, without tracebacks or
terminal escape codes."""

from __future__ import annotations

import traceback

import pytest

from vllm.exceptions import clean_message


def _chained_traceback() -> str:
    try:
        try:
            raise ValueError("inner\nsecond line")
        except ValueError as e:
            raise RuntimeError("outer \x1b[1;31mred\x1b[0m") from e
    except RuntimeError:
        return traceback.format_exc()


def test_a_traceback_keeps_only_its_exception_lines() -> None:
    text = clean_message("engine core died: boom\n" + _chained_traceback())
    assert text == "engine core died: boom ValueError: inner second line RuntimeError: outer red"


@pytest.mark.parametrize("raw,clean", [
    ("plain message", "plain message"),
    ("\x1b[31mred\x1b[0m text", "red text"),
    ("\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\ end", "link end"),
    ("bell\x07 nul\x00 tab\t cr\r csi8\x9b1mz", "bell nul tab cr csi8z"),
    ("  a\n\n  b  ", "a b"),
    ("see Traceback (most recent call last):\n  File \"x.py\", line 1\n    x()\nKeyError: 'k'",
     "see KeyError: 'k'"),
])
def test_escapes_controls_and_lines(raw: str, clean: str) -> None:
    assert clean_message(raw) == clean


def test_the_result_is_always_one_clean_line() -> None:
    text = clean_message(_chained_traceback() + "\x1b[2J\x1bc\n\x1b")
    assert "\n" not in text and "\x1b" not in text and "Traceback" not in text
