"""What upstream's benchmarks/benchmark_serving_structured_output.py needs from this engine,
checked without its files: the three names it imports from `vllm`, called as it calls them,
and its four datasets' request shapes (a streaming /v1/completions request per prompt, the
constraint in the body's `guided_*` field) against `vllm serve demo-tiny`, scored the way the
client scores them."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from .conftest import RemoteServer

MODEL = "demo-tiny"
# One request per dataset: (the client's structure type, the constraint, how it scores);
# the constraints have the client's kinds and shapes, bounded so a random model finishes.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Paris", "Lima"]}},
          "required": ["name", "age", "city"]}
SQL = """
root ::= query
query ::= "SELECT " field " FROM " source " WHERE " test
field ::= "id " | "name "
source ::= "people " | "places "
test ::= field "= " digit
digit ::= "1 " | "2 "
"""
EMAIL = r"\w{1,8}@\w{1,8}\.com\n"  # the client's shape, bounded for a random model
LABELS = ["Positive", "Negative"]


def _json_ok(text: str) -> bool:
    # As the client scores json: the first {...} of the compacted text must parse.
    found = re.search(r"\{.*\}", text.replace("\n", "").replace(" ", ""))
    if found is None:
        return False
    try:
        json.loads(found.group())
    except json.JSONDecodeError:
        return False
    return True


DATASETS = {
    "json": ("guided_json", SCHEMA, _json_ok),
    "grammar": ("guided_grammar", SQL, lambda t: t.startswith("SELECT ")),
    "regex": ("guided_regex", EMAIL, lambda t: re.match(EMAIL, t) is not None),
    "choice": ("guided_choice", LABELS, lambda t: t in LABELS),
}


@pytest.fixture(scope="module")
def server(start_server) -> RemoteServer:
    return start_server(MODEL, "--max-model-len", "1024", "--disable-log-requests",
                        "--structured-outputs-config.disable_any_whitespace", "true")


def test_the_names_it_imports_from_vllm() -> None:
    from vllm.transformers_utils.tokenizer import get_tokenizer
    from vllm.utils import FlexibleArgumentParser
    from vllm.v1.structured_output.backend_xgrammar import (
        has_xgrammar_unsupported_json_features,
    )

    tokenizer = get_tokenizer(MODEL, trust_remote_code=False, tokenizer_mode="auto")
    assert len(tokenizer("Generate a user profile").input_ids) > 0
    assert has_xgrammar_unsupported_json_features(SCHEMA) is False
    args = FlexibleArgumentParser().parse_args([])
    assert args is not None


@pytest.mark.parametrize("dataset", list(DATASETS))
def test_each_dataset_request_is_served_and_scores(server: RemoteServer, dataset: str) -> None:
    structure_type, constraint, score = DATASETS[dataset]
    body = {"model": MODEL, "prompt": f"Example for {dataset}:", "temperature": 0.0,
            "max_tokens": 128, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": False, structure_type: constraint}
    text, usage = "", None
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text += choice.get("text") or ""
    assert usage is not None and usage["completion_tokens"] > 0
    assert score(text), (dataset, text)
