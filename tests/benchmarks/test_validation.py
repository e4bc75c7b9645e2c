"""Tests for vllm/benchmarks/validation.py: valid outputs count, invalid and unconstrained do not."""

from __future__ import annotations

import json

import pytest
from vllm.benchmarks.datasets import EMAIL_REGEX, SQL_GRAMMAR, StructuredSpec, load_schema
from vllm.benchmarks.endpoint_request_func import RequestFuncOutput
from vllm.benchmarks.validation import evaluate, is_valid


@pytest.fixture(scope="module")
def schema() -> dict:
    return load_schema()


def out(text: str, finish: str = "stop", success: bool = True) -> RequestFuncOutput:
    return RequestFuncOutput(generated_text=text, success=success, finish_reason=finish)


def test_json_validates_against_the_schema_not_just_parses(schema: dict, valid_profile: dict) -> None:
    spec = StructuredSpec("json", schema)
    assert is_valid(json.dumps(valid_profile), spec)
    assert is_valid(json.dumps(valid_profile, indent=2), spec)
    for change in (
        {"age": 17},                 # below minimum
        {"role": "owner"},           # not in enum
        {"email": "not-an-email"},   # pattern
        {"extra": 1},                # additionalProperties false
        {"tags": []},                # minItems
    ):
        assert not is_valid(json.dumps({**valid_profile, **change}), spec), change
    missing = dict(valid_profile)
    del missing["address"]
    assert not is_valid(json.dumps(missing), spec)
    assert not is_valid(json.dumps(valid_profile)[:-1], spec)  # truncated
    assert is_valid('{"a": 1}', StructuredSpec("json", json.dumps({"type": "object"})))


def test_regex_choice_grammar() -> None:
    regex = StructuredSpec("regex", EMAIL_REGEX)
    assert is_valid("ada.lovelace@analytical.com", regex)
    assert not is_valid("ada.lovelace@analytical.com!", regex)  # full match only
    assert not is_valid("Ada.lovelace@analytical.com", regex)
    choice = StructuredSpec("choice", ["positive", "negative"])
    assert is_valid("negative", choice)
    assert not is_valid("negative ", choice) and not is_valid("neutral", choice)
    grammar = StructuredSpec("grammar", SQL_GRAMMAR)
    assert is_valid("SELECT username, email FROM users;", grammar)
    assert is_valid("SELECT id FROM orders WHERE id = 42;", grammar)
    assert not is_valid("SELECT username, email FROM users", grammar)  # unterminated
    assert not is_valid("SELECT password FROM users;", grammar)


def test_evaluate_counts_only_structured_requests(schema: dict, valid_profile: dict) -> None:
    spec = StructuredSpec("json", schema)
    good = json.dumps(valid_profile)
    outputs = [
        out(good),                          # valid
        out(good[:-1], finish="length"),    # truncated: invalid, not stopped
        out("plain text"),                  # unconstrained: excluded
        out("{}"),                          # stopped but invalid
        out(good, success=False),           # failed request: invalid
        out("anything at all"),             # unconstrained: excluded
    ]
    specs = [spec, spec, None, spec, spec, None]
    report, verdicts = evaluate(outputs, specs)
    assert verdicts == [True, False, None, False, False, None]
    assert (report.num_structured, report.num_valid) == (4, 1)
    assert (report.num_stopped, report.num_stopped_valid) == (2, 1)
    assert report.rate == pytest.approx(0.25)
    assert report.stopped_rate == pytest.approx(0.5)
    d = report.to_dict()
    assert d["correct_rate"] == pytest.approx(0.25) and d["num_structured"] == 4


def test_evaluate_without_structured_requests() -> None:
    report, verdicts = evaluate([out("a"), out("b")], [None, None])
    assert verdicts == [None, None]
    assert report.rate is None and report.stopped_rate is None
    with pytest.raises(ValueError, match="specs"):
        evaluate([out("a")], [])
