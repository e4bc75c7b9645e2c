"""The grammar oracle through the whole engine (demo vocabulary, temperature 1.0, several seeds).

Every generated token is accepted by a fresh matcher; every output that finished with "stop"
satisfies its constraint (jsonschema, re.fullmatch, choice membership, grammar recognizers).
Also: plain requests in a mixed batch are bit-for-bit what they are alone, invalid constraints
are rejected before the engine sees them, and a slow compile ends only its own request.
"""

from __future__ import annotations

import threading

import pytest

from tests.v1.structured_output.oracle import check_structured_output
from tests.v1.structured_output.schemas import ALL_CASES, GUIDANCE_ONLY, INVALID
from vllm import LLM, SamplingParams, StructuredOutputsParams

SEEDS = (1, 2)


@pytest.fixture(scope="module")
def llm():
    engine = LLM("demo-tiny", max_model_len=1024, max_num_seqs=256)
    yield engine
    engine.shutdown()


@pytest.fixture(autouse=True)
def nothing_leaks(llm):
    yield
    core = llm.llm_engine.engine_core
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert core.structured_output_manager.num_live_grammars == 0
    assert not core.scheduler.requests


def _params(case, seed: int) -> SamplingParams:
    compact = "json" in case.params or "json_object" in case.params
    options = {"disable_any_whitespace": True} if compact else {}
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=200,
        structured_outputs=case.make_params(**options),
    )


def test_every_constraint_kind_passes_the_oracle(llm) -> None:
    cases = [(case, seed) for case in ALL_CASES for seed in SEEDS]
    assert sum(1 for c in ALL_CASES if "json" in c.params) >= 40
    params = [_params(case, seed) for case, seed in cases]
    outputs = llm.generate(["Reply in the required format:"] * len(cases), params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    finished = 0
    for (case, _), p, out in zip(cases, params, outputs):
        completion = out.outputs[0]
        check_structured_output(p.structured_outputs, completion, tokenizer)
        if completion.finish_reason == "stop":
            case.check(completion.text)  # the corpus' own independent check
            finished += 1
    # Bounded constraints must mostly finish, or the validity checks above checked little.
    assert finished >= 0.8 * len(cases), f"only {finished}/{len(cases)} finished"
    kinds_finished = {
        next(iter(case.params))
        for (case, _), out in zip(cases, outputs)
        if out.outputs[0].finish_reason == "stop"
    }
    # json_object is unbounded (free-form keys and strings), so it need not finish.
    assert {"json", "regex", "choice", "grammar", "structural_tag"} <= kinds_finished


def test_constraints_only_llguidance_enforces_pass_the_oracle(llm) -> None:
    manager = llm.llm_engine.engine_core.structured_output_manager
    before = manager.backend_choices().get(("guidance", "fallback"), 0)
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=60,
                       structured_outputs=StructuredOutputsParams(**constraint))
        for _, constraint, _ in GUIDANCE_ONLY for seed in SEEDS
    ]
    outputs = llm.generate(["Reply in JSON:"] * len(params), params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for p, out in zip(params, outputs):
        check_structured_output(p.structured_outputs, out.outputs[0], tokenizer)
    assert sum(out.outputs[0].finish_reason == "stop" for out in outputs) >= len(outputs) // 2
    # Each went to llguidance because xgrammar refused it, and the choice was counted.
    after = manager.backend_choices().get(("guidance", "fallback"), 0)
    assert after - before == len(params)


def test_chat_with_json_schema(llm) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=50,
                            structured_outputs=StructuredOutputsParams(
                                json=schema, disable_any_whitespace=True))
    out = llm.chat([{"role": "user", "content": "JSON please"}], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    check_structured_output(params.structured_outputs, completion, llm.get_tokenizer())
    assert completion.finish_reason == "stop"


def test_plain_requests_unchanged_by_structured_neighbours(llm) -> None:
    prompts = ["The weather today", "def main():", "Once upon a time"]
    plain = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=12, top_k=50, top_p=0.9, max_tokens=16,
                       ignore_eos=True, logprobs=2),
    ]
    alone = llm.generate(prompts, plain, use_tqdm=False)
    structured = [_params(case, 5) for case in ALL_CASES[:20]]
    mixed = llm.generate(
        ["Reply:"] * 10 + prompts + ["Reply:"] * 10,
        structured[:10] + plain + structured[10:],
        use_tqdm=False,
    )[10:13]
    for a, m in zip(alone, mixed):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
        assert a.outputs[0].logprobs == m.outputs[0].logprobs


@pytest.mark.parametrize("name, constraint, fragment", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_constraints_rejected_before_the_engine(llm, name, constraint, fragment) -> None:
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match="structured_outputs") as info:
        llm.generate(["x", "y"], [SamplingParams(max_tokens=2), params], use_tqdm=False)
    assert fragment in str(info.value)
    assert not llm.llm_engine.engine_core.scheduler.requests


def test_slow_compile_ends_only_its_request(llm) -> None:
    manager = llm.llm_engine.engine_core.structured_output_manager
    original_compile = manager._compile
    slow_regex = "slow-[0-9]+"

    # The engine's compile of the slow constraint (the second; the first is the front end's
    # check) cannot finish before the test releases it, after the request ended: its
    # deadline fires first however slow the machine is.
    release, finished = threading.Event(), threading.Event()
    calls = [0]

    def compile_slowly(structured_req, *args):
        if structured_req.params.regex != slow_regex:
            return original_compile(structured_req, *args)
        calls[0] += 1
        if calls[0] == 1:
            return original_compile(structured_req, *args)
        structured_req.mark_started()
        release.wait(60)
        try:
            return original_compile(structured_req, *args)
        finally:
            finished.set()

    manager._compile = compile_slowly
    scheduler = llm.llm_engine.engine_core.scheduler
    timeout = scheduler.compile_timeout_s
    scheduler.compile_timeout_s = 0.2
    try:
        slow = SamplingParams(max_tokens=8,
                              structured_outputs=StructuredOutputsParams(regex=slow_regex))
        fast = SamplingParams(max_tokens=8,
                              structured_outputs=StructuredOutputsParams(regex="fast-[0-9]+"))
        plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = llm.generate(["a", "b", "c"], [slow, fast, plain], use_tqdm=False)
    finally:
        release.set()
        manager._compile = original_compile
        scheduler.compile_timeout_s = timeout
    assert outs[0].outputs[0].finish_reason == "error"
    assert "time" in outs[0].outputs[0].error
    assert outs[1].outputs[0].finish_reason in ("stop", "length")
    assert outs[1].outputs[0].text.startswith("fast-")
    assert len(outs[2].outputs[0].token_ids) == 8
    assert finished.wait(60)  # the abandoned compile ends before the leak check
