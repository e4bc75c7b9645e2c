"""Tests for vllm/benchmarks/datasets.py."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from vllm.benchmarks.assets import DEFAULT_SCHEMA_NAME, SCHEMA_NAMES, builtin_schema
from vllm.benchmarks.datasets import (
    SQL_GRAMMAR,
    STRUCTURED_DATASETS,
    StructuredSpec,
    build_structured_requests,
    load_custom_requests,
    load_schema,
    sample_random_requests,
    unique_schema,
)



def test_shipped_schemas_are_valid_json_schemas() -> None:
    assert DEFAULT_SCHEMA_NAME in SCHEMA_NAMES and len(SCHEMA_NAMES) >= 3
    for name in SCHEMA_NAMES:
        schema = load_schema(name)
        jsonschema.validators.validator_for(schema).check_schema(schema)
        assert schema["type"] == "object" and len(schema["properties"]) >= 4, name
    assert load_schema() == builtin_schema(DEFAULT_SCHEMA_NAME)
    assert load_schema("structured_schema_2")["title"] == "Order"


def test_schema_files_win_over_shipped_names(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"type": "object", "title": "FromFile"}))
    assert load_schema(path)["title"] == "FromFile"
    monkeypatch.chdir(tmp_path)
    (tmp_path / DEFAULT_SCHEMA_NAME).write_text(json.dumps({"title": "Local"}))
    assert load_schema(DEFAULT_SCHEMA_NAME) == {"title": "Local"}
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="json_schema_path: .* must hold a JSON object"):
        load_schema("list.json")
    with pytest.raises(ValueError, match=f"shipped schema .*{DEFAULT_SCHEMA_NAME}"):
        load_schema("structured_schema_99")


def test_shipped_schemas_are_copies() -> None:
    schema = load_schema()
    schema["properties"].clear()
    assert load_schema()["properties"]


@pytest.mark.parametrize("ratio, expected", [(0.0, 0), (0.2, 4), (0.5, 10), (0.8, 16), (1.0, 20)])
def test_structured_ratio_is_exact(char_tokenizer, ratio: float, expected: int) -> None:
    reqs = build_structured_requests("json", char_tokenizer, 20, 64, ratio, seed=3)
    assert sum(r.structured is not None for r in reqs) == expected


def test_same_prompts_for_every_ratio_and_seed_reproducible(char_tokenizer) -> None:
    for dataset in STRUCTURED_DATASETS:
        runs = [build_structured_requests(dataset, char_tokenizer, 12, 32, r, seed=5)
                for r in (0.0, 0.2, 0.8, 1.0)]
        prompts = [[r.prompt for r in run] for run in runs]
        assert all(p == prompts[0] for p in prompts), dataset
        again = build_structured_requests(dataset, char_tokenizer, 12, 32, 0.8, seed=5)
        assert again == runs[2], dataset
    a = build_structured_requests("json", char_tokenizer, 30, 32, 0.5, seed=1)
    b = build_structured_requests("json", char_tokenizer, 30, 32, 0.5, seed=2)
    assert [r.structured is None for r in a] != [r.structured is None for r in b]


def test_json_requests(char_tokenizer) -> None:
    schema = load_schema()
    reqs = build_structured_requests("json", char_tokenizer, 4, 100, 1.0)
    for r in reqs:
        assert r.structured == StructuredSpec("json", schema)
        assert r.prompt_len == len(r.prompt) and r.expected_output_len == 100
        assert json.dumps(schema, separators=(",", ":")) in r.prompt
        assert r.structured.request_fields() == {"structured_outputs": {"json": schema}}


def test_json_unique_gives_distinct_schemas(char_tokenizer) -> None:
    base = load_schema()
    reqs = build_structured_requests("json-unique", char_tokenizer, 5, 64, 1.0)
    schemas = [r.structured.value for r in reqs]
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == 5
    for i, s in enumerate(schemas):
        assert s["properties"][f"flag_{i}"] == {"type": "boolean"}
        assert s["required"] == base["required"] + [f"flag_{i}"]
    assert base == load_schema()  # the shared schema is not mutated
    assert unique_schema({"type": "object"}, 2)["required"] == ["flag_2"]


def test_other_kinds(char_tokenizer) -> None:
    grammar = build_structured_requests("grammar", char_tokenizer, 2, 32, 1.0)
    assert grammar[0].structured == StructuredSpec("grammar", SQL_GRAMMAR)
    regex = build_structured_requests("regex", char_tokenizer, 2, 32, 1.0)
    assert regex[0].structured.kind == "regex"
    choice = build_structured_requests("choice", char_tokenizer, 40, 8, 1.0, seed=0)
    assert {tuple(r.structured.value) for r in choice} == {("positive", "negative", "neutral")}
    assert len({r.prompt for r in choice}) > 1  # reviews vary


def test_bad_structured_arguments(char_tokenizer) -> None:
    with pytest.raises(ValueError, match="dataset"):
        build_structured_requests("xml", char_tokenizer, 2, 8)
    with pytest.raises(ValueError, match="structured_output_ratio"):
        build_structured_requests("json", char_tokenizer, 2, 8, 1.5)
    with pytest.raises(ValueError, match="num_prompts"):
        build_structured_requests("json", char_tokenizer, 0, 8)
    with pytest.raises(ValueError, match="kind"):
        StructuredSpec("yaml", {})
    with pytest.raises(ValueError, match="json_schema_path"):
        load_schema("/nonexistent/schema.json")


def test_random_requests(char_tokenizer) -> None:
    reqs = sample_random_requests(char_tokenizer, 50, 40, 16, range_ratio=0.25, prefix_len=5, seed=7)
    assert len(reqs) == 50
    for r in reqs:
        assert 5 + 30 <= r.prompt_len <= 5 + 50
        assert 12 <= r.expected_output_len <= 20
        assert r.prompt_len == len(r.prompt)
    assert len({r.prompt[:5] for r in reqs}) == 1  # the shared prefix
    assert len({r.prompt_len for r in reqs}) > 1
    assert sample_random_requests(char_tokenizer, 50, 40, 16, 0.25, 5, seed=7) == reqs
    fixed = sample_random_requests(char_tokenizer, 3, 10, 4, seed=1)
    assert [(r.prompt_len, r.expected_output_len) for r in fixed] == [(10, 4)] * 3
    with pytest.raises(ValueError, match="random_range_ratio"):
        sample_random_requests(char_tokenizer, 3, 10, 4, range_ratio=1.0)


def test_custom_requests(char_tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    rows = [{"prompt": f"prompt number {i}"} for i in range(6)] + [{"prompt": "long", "output_tokens": 3}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    ordered = load_custom_requests(path, char_tokenizer, 7, 50, shuffle=False)
    assert [r.prompt for r in ordered] == [r["prompt"] for r in rows]
    assert [r.expected_output_len for r in ordered] == [50] * 6 + [3]
    shuffled = load_custom_requests(path, char_tokenizer, 7, 50, seed=4)
    assert sorted(r.prompt for r in shuffled) == sorted(r.prompt for r in ordered)
    assert load_custom_requests(path, char_tokenizer, 7, 50, seed=4) == shuffled
    with pytest.raises(ValueError, match="num_prompts"):
        load_custom_requests(path, char_tokenizer, 8, 50)
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=":1: needs a string 'prompt'"):
        load_custom_requests(path, char_tokenizer, 1, 50)
