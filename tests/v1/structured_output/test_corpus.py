"""The real-world schema corpus (tests/data/schema_corpus): structured outputs never lie.

Every schema is compiled by the engine's default `auto` backend; at least 98 % must be
accepted, and each refusal must be a 400-kind error that names the keyword. Every accepted
schema is then generated against once with the demo model at temperature 1.0: no request may
fail, every token must pass the grammar oracle, and every output that finishes with `stop`
must validate against its schema under the rules of the schema's own `$schema` draft.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from tests.v1.structured_output.oracle import (
    check_structured_output,
    oracle_backend,
    validate_json,
)
from tests.v1.structured_output.walker import random_walk
from vllm import LLM, SamplingParams, StructuredOutputsParams
from vllm.config import StructuredOutputsConfig
from vllm.exceptions import GrammarCompileError, UnsupportedConstraintError
from vllm.v1.structured_output.backends.auto import create_backend

from .conftest import EOS_IDS, VOCAB_SIZE

CORPUS_DIR = Path(__file__).resolve().parents[2] / "data" / "schema_corpus"
# The acceptance this corpus reaches today (216 of 216; see the README of the corpus for the
# stricter rewrites that took the last refusals).
MIN_ACCEPTED = 1.0
MAX_TOKENS = 64


def load_corpus() -> list[dict[str, Any]]:
    """Every corpus entry ({"name", "source", "schema"}), in file then list order."""
    entries: list[dict[str, Any]] = []
    for path in sorted(CORPUS_DIR.glob("*.json")):
        entries.extend(json.loads(path.read_text()))
    return entries


CORPUS = load_corpus()


def test_corpus_is_large_and_valid() -> None:
    assert len(CORPUS) >= 150
    assert len({e["name"] for e in CORPUS}) == len(CORPUS)
    for entry in CORPUS:
        schema = entry["schema"]
        jsonschema.validators.validator_for(schema).check_schema(schema)


def _compact(schema: Any) -> StructuredOutputsParams:
    """A schema as the engine test asks for it (compact JSON: more outputs finish)."""
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


@pytest.fixture(scope="module")
def verdicts(tokenizer: Any) -> dict[str, GrammarCompileError | None]:
    """Each schema's compile outcome with a default backend that is not the engine's (the
    oracle's, so its compile of each engine output is then a cache hit): None when
    accepted."""
    backend = oracle_backend(tokenizer, VOCAB_SIZE, tuple(EOS_IDS))
    out: dict[str, GrammarCompileError | None] = {}
    for entry in CORPUS:
        try:
            backend.compile_grammar(_compact(entry["schema"]))
            out[entry["name"]] = None
        except GrammarCompileError as e:
            out[entry["name"]] = e
    return out


def test_most_schemas_are_accepted_and_refusals_name_the_keyword(verdicts) -> None:
    refused = {name: e for name, e in verdicts.items() if e is not None}
    accepted = 1 - len(refused) / len(verdicts)
    print(f"schema corpus: {len(verdicts) - len(refused)}/{len(verdicts)} accepted "
          f"({accepted:.1%}); refused: {sorted(refused)}")
    assert accepted >= MIN_ACCEPTED, {n: str(e) for n, e in refused.items()}
    for name, error in refused.items():
        assert error.param == "structured_outputs.json", name
        # Names where and what: a location in the schema and a quoted keyword.
        assert "#" in error.message and "'" in error.message, (name, error.message)
        assert isinstance(error, (UnsupportedConstraintError, GrammarCompileError)), name


def test_the_oracle_checks_multiple_of_on_decimal_values() -> None:
    schema = {"type": "number", "multipleOf": 0.01}
    validate_json(4937.49, schema)  # 4937.49 / 0.01 is 493748.99999999994 in floats
    with pytest.raises(jsonschema.ValidationError, match="multiple"):
        validate_json(4937.495, schema)


def test_a_pattern_xgrammar_matches_wrongly_is_enforced_exactly(tokenizer: Any) -> None:
    """xgrammar 0.2.9 let "RGBOKV" through `^[A-Z]{1,5}(\\.[A-Z]{1,2})?$` (found by the
    generation test below); `auto` now gives such patterns to llguidance."""
    backend = create_backend(StructuredOutputsConfig(), tokenizer, VOCAB_SIZE, EOS_IDS)
    schema = {"type": "string", "pattern": r"^[A-Z]{1,5}(\.[A-Z]{1,2})?$"}
    try:
        for text, ok in (('"RGBOKV"', False), ('"BRK.B"', True), ('"AAPL"', True)):
            grammar = backend.compile_grammar(StructuredOutputsParams(json=schema))
            ids = tokenizer.encode(text, add_special_tokens=False) + [EOS_IDS[0]]
            assert grammar.accept_tokens("t", ids) == ok, text
    finally:
        backend.destroy()


# Keywords normalize_json_schema rewrites by a stricter or an equivalent schema; a random
# model rarely finishes such schemas, so the rewrites are walked to the end (steered to stop).
_REWRITTEN = ("contains", "propertyNames", "minProperties", "unevaluatedProperties", "oneOf",
              "not", "allOf", "if", "uniqueItems")


def _bounds_a_pattern(node: Any) -> bool:
    """True when a subschema has a pattern or format beside a length bound (xgrammar takes
    them as one pattern: schema/lengths.py)."""
    if isinstance(node, list):
        return any(_bounds_a_pattern(v) for v in node)
    if not isinstance(node, dict):
        return False
    if ({"pattern", "format"} & set(node) and {"minLength", "maxLength"} & set(node)
            and all(isinstance(node.get(k), (str, type(None))) for k in ("pattern", "format"))):
        return True
    return any(_bounds_a_pattern(v) for v in node.values())


@pytest.mark.slow
def test_walks_through_rewritten_schemas_validate(verdicts, tokenizer, walk_vocab) -> None:
    entries = [e for e in CORPUS if verdicts[e["name"]] is None
               and (any(f'"{k}"' in json.dumps(e["schema"]) for k in _REWRITTEN)
                    or _bounds_a_pattern(e["schema"]))]
    assert len(entries) >= 10
    backend = create_backend(StructuredOutputsConfig(max_whitespace=1), tokenizer, VOCAB_SIZE,
                             EOS_IDS)
    try:
        for i, entry in enumerate(entries):
            params = StructuredOutputsParams(json=entry["schema"])
            grammar = backend.compile_grammar(params)
            rng = np.random.default_rng(i)
            # Steered walks can spend hundreds of tokens in an `email` local part, where
            # the closing characters the walker prefers are allowed too.
            tokens, stopped = random_walk(grammar, walk_vocab, rng, finish_after=60,
                                          max_steps=2000)
            assert stopped, entry["name"]
            text = tokenizer.decode(tokens[:-1], skip_special_tokens=False)
            validate_json(json.loads(text), entry["schema"])
    finally:
        backend.destroy()


@pytest.mark.slow
def test_outputs_that_stop_validate_against_their_own_draft(verdicts, tokenizer) -> None:
    entries = [e for e in CORPUS if verdicts[e["name"]] is None]
    llm = LLM("demo-tiny", max_model_len=1024, max_num_seqs=256)
    try:
        params = [
            SamplingParams(
                max_tokens=MAX_TOKENS, temperature=1.0, seed=i,
                # Compact JSON: a random model's tokens go to values, so more outputs finish.
                structured_outputs=_compact(e["schema"]),
            )
            for i, e in enumerate(entries)
        ]
        prompts = [f"Write one {e['name'].replace('-', ' ')} as JSON:" for e in entries]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    stopped = 0
    for entry, param, output in zip(entries, params, outputs, strict=True):
        completion = output.outputs[0]
        # No errors; every token passes a fresh matcher; `stop` outputs validate with
        # jsonschema under the schema's `$schema` draft.
        check_structured_output(param.structured_outputs, completion, tokenizer)
        stopped += completion.finish_reason == "stop"
    print(f"schema corpus: {stopped}/{len(entries)} outputs finished with stop "
          f"and validated")
    assert stopped > 0
