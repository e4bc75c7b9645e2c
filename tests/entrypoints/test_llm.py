"""The offline LLM API on the tiny demo model: outputs, seeds, chat, bad input, no leaks."""

from __future__ import annotations

import json

import pytest

from vllm import LLM, SamplingParams, StructuredOutputsParams

PROMPTS = [
    "Hello world",
    "The quick brown fox",
    "def fibonacci(n):",
    "你好，世界",
    "1 2 3 4 5 6 7 8 9 10",
    "A",
]


@pytest.fixture(scope="module")
def llm():
    engine = LLM("demo-tiny", max_model_len=256, max_num_seqs=16, seed=0)
    yield engine
    engine.shutdown()


@pytest.fixture(autouse=True)
def pool_is_full_after(llm):
    yield
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert not llm.llm_engine.engine_core.scheduler.requests


def test_outputs_have_tokens_text_and_finish_reason(llm) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                        use_tqdm=False)
    tok = llm.get_tokenizer()
    assert [o.prompt for o in outs] == PROMPTS
    for o in outs:
        (c,) = o.outputs
        assert len(c.token_ids) == 7
        assert c.finish_reason == "length"
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert o.prompt_token_ids == tok.encode(o.prompt, add_special_tokens=False)


def test_greedy_is_deterministic_and_batch_independent(llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    batch = llm.generate(PROMPTS, params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS[:3]]
    for a, b in zip(alone, batch):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_seeded_sampling_reproducible_and_independent_of_batch(llm) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == again
    others = [SamplingParams(temperature=0.7, seed=i, max_tokens=5, top_k=20) for i in range(4)]
    others.append(SamplingParams(temperature=1.0, max_tokens=9))  # unseeded neighbour
    mixed = llm.generate(
        PROMPTS[1:6] + [PROMPTS[0]], others + [seeded], use_tqdm=False
    )[-1].outputs[0].token_ids
    assert mixed == alone
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=12, ignore_eos=True)
    assert llm.generate([PROMPTS[0]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_gives_distinct_sequences(llm) -> None:
    out = llm.generate(["Once upon"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_stop_string_truncates_and_frees(llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = llm.generate(["Hello world"], params, use_tqdm=False)[0].outputs[0].text
    assert len(full) > 4
    stop = full[2:4]
    cut = llm.generate(["Hello world"], SamplingParams(temperature=0.0, max_tokens=30,
                                                       ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate(["Hello world"], SamplingParams(temperature=0.0, max_tokens=30,
                                                        ignore_eos=True, stop=[stop],
                                                        include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full[: full.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    tokens = llm.generate(["Hello world"], params, use_tqdm=False)[0].outputs[0].token_ids
    target = tokens[3]
    first = tokens.index(target)
    out = llm.generate(["Hello world"], SamplingParams(temperature=0.0, max_tokens=10,
                                                       ignore_eos=True, stop_token_ids=[target]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    # min_tokens bans the stop id until min_tokens outputs exist.
    out = llm.generate(["Hello world"], SamplingParams(temperature=0.0, max_tokens=10,
                                                       ignore_eos=True, stop_token_ids=[target],
                                                       min_tokens=first + 2),
                       use_tqdm=False)[0].outputs[0]
    assert target not in out.token_ids[: first + 2]


def test_logprobs(llm) -> None:
    out = llm.generate(["Hello world"], SamplingParams(temperature=0.0, max_tokens=4,
                                                       logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    tokenizer = llm.get_tokenizer()
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp
        # Greedy picks the most likely token: rank 1, the highest logprob.
        assert lp[token].logprob == max(v.logprob for v in lp.values())
        assert lp[token].rank == 1
        assert len(lp) >= 3 and all(v.logprob <= 0 for v in lp.values())
        # The top-k alternatives are ranked 1..k in order of their logprobs.
        others = sorted((v for t, v in lp.items() if t != token), key=lambda v: v.rank)
        assert [v.rank for v in others] == list(range(2, 2 + len(others)))
        assert all(a.logprob >= b.logprob for a, b in zip(others, others[1:]))
        assert all(v.decoded_token == tokenizer.decode([t]) for t, v in lp.items())
    assert out.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs))
    )


def test_chat_uses_template(llm) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>user\nHi!<|im_end|>\n")
    assert out.prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", SamplingParams(), "prompt"),
        ("word " * 300, SamplingParams(), "prompt"),
        ([10**7], SamplingParams(), "prompt_token_ids"),
        ("fine", SamplingParams(stop_token_ids=[10**7]), "stop_token_ids"),
        # The server's rule: the prompt plus max_tokens must fit in max_model_len (256).
        ("fine", SamplingParams(max_tokens=256), "max_tokens"),
        ({"prompt_token_ids": [5] * 200}, SamplingParams(max_tokens=57), "max_tokens"),
    ],
)
def test_bad_prompts_raise_and_engine_stays_usable(llm, prompt, params, field) -> None:
    with pytest.raises(ValueError, match=field):
        llm.generate([PROMPTS[0], prompt], params, use_tqdm=False)
    assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_prompt_plus_max_tokens_may_fill_the_context(llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": [5] * 250}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"n": 0}, "n"),
        ({"logprobs": 100}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_sampling_params(kwargs, field) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


def test_bad_model_directories(tmp_path) -> None:
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "--max-num-batched-tokens"),
        ({"block_size": 3}, "--block-size"),
        ({"dtype": "int8"}, "--dtype"),
        ({"load_format": "pickle"}, "--load-format"),
        ({"distributed_executor_backend": "dask"}, "--distributed-executor-backend"),
        ({"max_model_len": 100000}, "--max-model-len"),
        ({"num_gpu_blocks_override": 2, "max_model_len": 256}, "--kv-cache-memory"),
        ({"structured_outputs_config": {"bogus": 1}}, "--structured-outputs-config"),
    ],
)
def test_invalid_engine_options_name_the_flag(kwargs, flag) -> None:
    with pytest.raises(ValueError, match=flag):
        LLM("demo-tiny", **kwargs)


@pytest.mark.parametrize(
    "constraint, fragment",
    [
        ({"json": {"anyOf": []}}, "'anyOf' is an empty list"),
        (
            {
                "json": {
                    "type": "object",
                    "properties": {},
                    "required": ["a"],
                    "additionalProperties": False,
                }
            },
            "required property 'a'",
        ),
        ({"grammar": 'root ::= root "a"'}, "rule 'root' can never finish"),
        ({"choice": [str(i) for i in range(10_000)]}, "max_enum_values"),
    ],
)
def test_unsatisfiable_or_oversized_constraints_raise(llm, constraint, fragment) -> None:
    kind = next(iter(constraint))
    params = SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(**constraint)
    )
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{kind}: ") as info:
        llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert fragment in str(info.value)
    assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_offline_compile_is_bounded_by_the_timeout(llm, monkeypatch) -> None:
    # The engine's config object, read by its structured-output manager on each compile.
    config = llm.llm_engine.vllm_config.structured_outputs_config
    monkeypatch.setattr(config, "compile_timeout_s", 0.05)
    # About a second to compile (150 patterned strings): far past 0.05 s.
    schema = {
        "type": "object",
        "properties": {
            f"offline_{i}": {"type": "string", "pattern": "^[a-z]{1,200}$"} for i in range(150)
        },
    }
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=schema))
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: .*longer than 0.05 s"):
        llm.generate([PROMPTS[0]], params, use_tqdm=False)
