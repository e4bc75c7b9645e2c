"""Tests for benchmarks/soak.py's oracles (the soak itself runs for minutes; the README and
the closing notes give its command)."""

from __future__ import annotations

import os

import pytest

from tests.benchmarks.scripts import load_script

soak = load_script("soak")


@pytest.mark.parametrize(("kind", "text"), [
    ("json", '{"name": "a", "n": 3, "tags": []}'), ("regex", "ab-12"), ("choice", "beta")])
def test_valid_outputs_pass(kind: str, text: str) -> None:
    soak.check(kind, text)


@pytest.mark.parametrize(("kind", "text"), [
    ("json", '{"name": "a", "n": 3}'), ("json", "{"), ("regex", "ab-1234"),
    ("choice", "delta")])
def test_invalid_outputs_fail(kind: str, text: str) -> None:
    with pytest.raises(Exception):  # noqa: B017 - jsonschema, json and ValueError alike
        soak.check(kind, text)


def test_resident_memory_counts_this_process() -> None:
    assert soak.rss_mib(os.getpid()) > 1
    assert soak.rss_mib(2**22 + 12345) == 0  # no such process
