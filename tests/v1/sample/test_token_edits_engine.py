"""logit_bias, allowed_token_ids and bad_words through the whole engine (processor -> runner ->
sampler), sync and async, plain and with a JSON schema."""

from __future__ import annotations

import json

import pytest

from vllm import LLM, SamplingParams, StructuredOutputsParams
from vllm.exceptions import InvalidRequestError

PROMPTS = ["alpha beta gamma", "the quick brown fox", "one two three four five"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request):
    engine = LLM("demo-tiny", max_model_len=256, max_num_seqs=16, seed=0,
                 async_scheduling=request.param)
    yield engine
    engine.shutdown() if hasattr(engine, "shutdown") else None


def _tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_a_plus_100_bias_forces_the_token(llm) -> None:
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=6, temperature=temperature, seed=3, ignore_eos=True,
                                logit_bias={"1234": 100})
        assert all(t == [1234] * 6 for t in _tokens(llm, params))


def test_a_minus_100_bias_bans_the_greedy_choice(llm) -> None:
    plain = _tokens(llm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    banned = {t for toks in plain for t in toks}
    bias = {t: -100 for t in banned}
    got = _tokens(llm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                      logit_bias=bias))
    assert all(not set(toks) & banned for toks in got)


def test_allowed_token_ids_bound_every_token(llm) -> None:
    allowed = [11, 220, 1879, 9707]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1, ignore_eos=True,
                            allowed_token_ids=allowed)
    assert all(set(toks) <= set(allowed) for toks in _tokens(llm, params))


def test_bad_words_never_appear_and_other_rows_are_unchanged(llm) -> None:
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
    # A two-token word the model writes greedily (its second token must not follow its
    # first) whose text encodes back to those tokens; else (the tilted demo repeats one
    # closing token, and two of them merge differently) one token, banned everywhere.
    first = list(plain[0].outputs[0].token_ids)
    tokenizer = llm.get_tokenizer()
    pairs = (first[i:i + 2] for i in range(2, len(first) - 1))
    banned = next((p for p in pairs
                   if tokenizer.encode(tokenizer.decode(p), add_special_tokens=False) == p),
                  first[2:3])
    word = tokenizer.decode(banned)
    outs = llm.generate(
        PROMPTS,
        [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, bad_words=[word]),
         SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
         SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)],
        use_tqdm=False,
    )
    # Banned are tokens, not text: the tilted demo may spell the same text otherwise.
    got, n = list(outs[0].outputs[0].token_ids), len(banned)
    assert word.strip() and all(got[i:i + n] != banned for i in range(len(got) - n + 1))
    assert got != first
    for o, p in zip(outs[1:], plain[1:]):
        assert o.outputs[0].token_ids == p.outputs[0].token_ids


def test_bias_combines_with_a_json_schema(llm) -> None:
    # "{" (token 90) forced everywhere cannot break the grammar: outputs stay valid JSON.
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=5, structured_outputs=so,
                            logit_bias={90: 100, 1: 5})
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        if out.outputs[0].finish_reason == "stop":
            value = json.loads(out.outputs[0].text)
            assert set(value) == {"name", "n"}


def test_out_of_vocabulary_ids_are_refused(llm) -> None:
    for kw, field in ((dict(logit_bias={10**8: 1}), "logit_bias"),
                      (dict(allowed_token_ids=[10**8]), "allowed_token_ids")):
        with pytest.raises(InvalidRequestError, match=field):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, **kw), use_tqdm=False)


def test_allowed_tokens_all_banned_is_refused(llm) -> None:
    word_id = llm.get_tokenizer().encode("Hello", add_special_tokens=False)
    assert len(word_id) == 1
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, allowed_token_ids=word_id,
                                                 bad_words=["Hello"]), use_tqdm=False)
