"""The contract the compatibility backends (outlines, lm-format-enforcer) share with the main
ones, as functions their test modules call with their own backend.

Oracles: outputs of random walks validate independently (the corpus' jsonschema, re.fullmatch
and membership checks); at every step of a walk, each token the backend allows is one a
reference backend (xgrammar, which enforces the same language) allows at the same position,
so the mask never leads outside the language.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest

from vllm.exceptions import GrammarCompileError, UnsupportedConstraintError
from vllm.sampling_params import StructuredOutputsParams

from .conftest import EOS_IDS, VOCAB_SIZE
from .schemas import ALL_CASES, Case
from .walker import WalkVocab, allowed_token_ids, random_walk

WORDS = (VOCAB_SIZE + 31) // 32
SPECIAL_IDS = frozenset(range(151_643, 151_657))
TOKENIZER_END = 151_669
MAX_WHITESPACE = 2


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def row_of(grammar: Any) -> np.ndarray:
    bitmask = np.zeros((1, WORDS), dtype=np.int32)
    grammar.fill_bitmask(bitmask, 0)
    return bitmask[0]


def allowed(grammar: Any) -> np.ndarray:
    return allowed_token_ids(row_of(grammar), VOCAB_SIZE)


def forbidden_allowed(ids: np.ndarray) -> list[int]:
    """Allowed ids that are Qwen special tokens (other than stops) or past the tokenizer."""
    return [int(i) for i in ids if (i in SPECIAL_IDS or i >= TOKENIZER_END) and i not in EOS_IDS]


def walkable_cases(kinds: tuple[str, ...]) -> list[Case]:
    """Corpus cases of `kinds` (json_object excluded: free-form, so unbounded)."""
    return [c for c in ALL_CASES if next(iter(c.params)) in kinds]


def params_of(case: Case) -> StructuredOutputsParams:
    if "json" in case.params:
        return case.make_params(max_whitespace=MAX_WHITESPACE)
    return case.make_params()


def walk_case(backend: Any, case: Case, tokenizer: Any, walk_vocab: WalkVocab,
              pieces: list[bytes]) -> bool:
    """Walks `case` once under `backend` and checks the output; False when the backend
    refuses the case (UnsupportedConstraintError)."""
    params = params_of(case)
    try:
        grammar = backend.compile_grammar(params)
    except UnsupportedConstraintError as e:
        assert e.param.startswith("structured_outputs."), e
        assert backend.name in e.message, e.message
        return False
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    tokens, stopped = random_walk(grammar, walk_vocab, rng)
    assert stopped, f"{case.name}: walk did not finish: {tokenizer.decode(tokens)!r}"
    body = tokens[:-1]
    assert not forbidden_allowed(np.array(body, dtype=np.int64)), body
    raw = b"".join(pieces[t] for t in body)
    text = raw.decode("utf-8")  # strict: raises on invalid UTF-8
    case.check(text)
    fresh = backend.compile_grammar(params)
    assert fresh.accept_tokens("fresh", tokens) and fresh.is_terminated()
    assert fresh.num_processed_tokens == len(tokens)
    return True


def masks_stay_in_language(backend: Any, reference: Any, params: StructuredOutputsParams,
                           walk_vocab: WalkVocab, seed: int) -> int:
    """Walks `params` under `backend` with a `reference` grammar in lockstep; at every step
    every allowed token must be one the reference allows. Returns the number of steps."""
    grammar = backend.compile_grammar(params)
    ref = reference.compile_grammar(params)
    rng = np.random.default_rng(seed)
    steps = 0
    while not grammar.is_terminated() and steps < 60:
        row = row_of(grammar)
        mine = allowed_token_ids(row, VOCAB_SIZE)
        assert len(mine), f"no token allowed after {steps} steps"
        outside = row & ~row_of(ref)
        assert not outside.any(), (steps, allowed_token_ids(outside, VOCAB_SIZE)[:10])
        stops = np.isin(mine, EOS_IDS)
        rest = mine[~stops]
        if stops.any() and (not len(rest) or steps > 25):
            token = int(mine[stops][0])
        else:
            pool = rest[walk_vocab.is_short[rest]] if steps > 25 else rest
            pool = pool if len(pool) else rest
            token = int(pool[rng.integers(len(pool))])
        assert grammar.accept_tokens("m", [token]) and ref.accept_tokens("m", [token])
        steps += 1
    return steps


def check_matcher_state(backend: Any, tokenizer: Any) -> None:
    """accept / reject / validate / rollback / termination, as test_backends checks them."""
    grammar = backend.compile_grammar(StructuredOutputsParams(regex="abc[0-9]{2}"))
    ids = [encode(tokenizer, c)[0] for c in "abc12"]
    wrong = encode(tokenizer, "z")[0]
    start = allowed(grammar)

    assert grammar.validate_tokens(ids[:2] + [wrong] + ids[2:]) == ids[:2]
    assert grammar.validate_tokens(ids + [EOS_IDS[0], wrong]) == ids + [EOS_IDS[0]]
    assert grammar.validate_tokens(ids[:3] + [EOS_IDS[0]]) == ids[:3]
    assert grammar.num_processed_tokens == 0 and np.array_equal(allowed(grammar), start)

    assert not grammar.accept_tokens("r", ids[:2] + [wrong, ids[2]])
    assert grammar.num_processed_tokens == 2
    after_two = allowed(grammar)
    for token in (wrong, ids[3], EOS_IDS[0], 151644, 151700, VOCAB_SIZE - 1, VOCAB_SIZE + 5, -1):
        assert not grammar.accept_tokens("r", [token]), token
        assert grammar.validate_tokens([token]) == [], token
        assert grammar.num_processed_tokens == 2
        assert np.array_equal(allowed(grammar), after_two), token
    assert grammar.accept_tokens("r", ids[2:4])
    grammar.rollback(2)
    assert grammar.num_processed_tokens == 2 and np.array_equal(allowed(grammar), after_two)
    with pytest.raises(ValueError, match="rollback"):
        grammar.rollback(3)
    with pytest.raises(ValueError, match="rollback"):
        grammar.rollback(-1)

    assert grammar.accept_tokens("r", ids[2:])
    assert sorted(allowed(grammar).tolist()) == sorted(EOS_IDS)  # complete: only stops
    assert grammar.accept_tokens("r", [EOS_IDS[1]])
    assert grammar.is_terminated() and grammar.num_processed_tokens == 6
    assert not grammar.accept_tokens("r", [EOS_IDS[0]]) and grammar.validate_tokens([ids[0]]) == []
    bitmask = np.zeros((3, WORDS), dtype=np.int32)
    grammar.fill_bitmask(bitmask, 1)
    assert (bitmask[1] == -1).all() and not bitmask[0].any() and not bitmask[2].any()
    grammar.rollback(1)
    assert not grammar.is_terminated()
    grammar.rollback(grammar.num_processed_tokens)
    assert grammar.num_processed_tokens == 0 and np.array_equal(allowed(grammar), start)


def check_batched_fill(backend: Any, tokenizer: Any) -> None:
    """fill_bitmasks writes exactly the rows asked, each equal to the grammar's own fill."""
    prompts = [({"regex": "[a-z]{2,5}-[0-9]+"}, "ab"), ({"choice": ["red", "green"]}, "gre"),
               ({"json": {"type": "object", "properties": {"a": {"type": "boolean"}}}}, '{"a":'),
               ({"regex": "ab"}, "ab")]
    grammars = []
    for params, prefix in prompts:
        grammar = backend.compile_grammar(StructuredOutputsParams(**params))
        assert grammar.accept_tokens("r", encode(tokenizer, prefix))
        grammars.append(grammar)
    done = backend.compile_grammar(StructuredOutputsParams(regex="x"))
    assert done.accept_tokens("r", encode(tokenizer, "x") + [EOS_IDS[0]])
    grammars.append(done)
    rows = [6, 0, 3, 1, 4]
    sentinel = np.int32(0x5A5A5A5A)
    bitmask = np.full((7, WORDS), sentinel, dtype=np.int32)
    backend.fill_bitmasks(grammars, bitmask, rows)
    for grammar, row in zip(grammars, rows):
        single = np.zeros((1, WORDS), dtype=np.int32)
        grammar.fill_bitmask(single, 0)
        assert np.array_equal(bitmask[row], single[0]), row
        if grammar is not done:
            assert not forbidden_allowed(allowed_token_ids(bitmask[row], VOCAB_SIZE))
    assert (bitmask[4] == -1).all() and (bitmask[[2, 5]] == sentinel).all()


def check_refusals(backend: Any) -> None:
    """What the backend cannot enforce is refused naming the field, the feature and the
    backend; what is invalid is a plain compile error."""
    unsupported = [
        ({"grammar": 'root ::= "a"'}, "grammar"),
        ({"structural_tag": {"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}],
                             "triggers": ["<f>"]}}, "structural_tag"),
        ({"json": {"type": "integer", "minimum": 3}}, "'minimum'"),
        ({"json": {"type": "object", "patternProperties": {"^a": {"type": "integer"}}}},
         "'patternProperties'"),
        ({"json": {"type": "string", "pattern": "^.+$"}}, "pattern"),
        ({"regex": "(?=a)a"}, "(?="),
        ({"regex": r"(a)\1"}, "\\1"),
    ]
    for constraint, fragment in unsupported:
        with pytest.raises(UnsupportedConstraintError) as info:
            backend.compile_grammar(StructuredOutputsParams(**constraint))
        field = next(iter(constraint))
        assert info.value.param == f"structured_outputs.{field}", info.value
        assert fragment in info.value.message and backend.name in info.value.message, info.value
    for constraint in ({"regex": "a(b"}, {"regex": "[z-a]"},
                       {"json": {"type": "string", "minLength": 5, "maxLength": 2}}):
        with pytest.raises(GrammarCompileError) as info:
            backend.compile_grammar(StructuredOutputsParams(**constraint))
        assert not isinstance(info.value, UnsupportedConstraintError), info.value


def check_draft_rows(backend: Any, tokenizer: Any) -> None:
    """Speculative decoding's rows (fill_draft_rows: accept each draft, fill, roll back):
    each row equals a fresh grammar's mask after the same prefix, rows from a rejected draft
    on allow everything, and the grammar ends as it was."""
    from vllm.v1.structured_output.draft_rows import fill_draft_rows

    params = StructuredOutputsParams(regex="[a-c]{2}-[0-9]{1,3}")
    grammar = backend.compile_grammar(params)
    assert grammar.accept_tokens("d", encode(tokenizer, "a"))
    before = allowed(grammar)
    drafts = [encode(tokenizer, c)[0] for c in "b-1"] + [encode(tokenizer, "z")[0], EOS_IDS[0]]
    bitmask = np.zeros((1 + len(drafts), WORDS), dtype=np.int32)
    grammar.fill_bitmask(bitmask, 0)
    fill_draft_rows("d", grammar, drafts, bitmask, 0)
    for j in range(1, 4):
        fresh = backend.compile_grammar(params)
        assert fresh.accept_tokens("d", encode(tokenizer, "a") + drafts[:j])
        assert np.array_equal(bitmask[j], row_of(fresh)), j
    assert (bitmask[4:] == -1).all()  # after the rejected "z"
    assert grammar.num_processed_tokens == 1 and np.array_equal(allowed(grammar), before)
