"""Oracles for grammar fast-forward's modes on the demo model (vllm/v1/spec_decode/
fast_forward.py), on one server started with `canonical`:

- canonical: every output passes a fresh matcher and `jsonschema`, every forced draft of a
  synchronous step is kept, and sync and async scheduling give the same outputs;
- a request's own `exact` gives the tokens and logprobs of its own `off` (greedy and
  seeded, sync and async);
- with a reasoning parser, the thinking is token for token what it is without
  fast-forward: nothing forced or pinned enters it (drafts are never scheduled inside it);
- canonical outputs are the same when requests are preempted and recomputed;
- exact mode needs only bitmasks: a compat backend (outlines) has it too.

The exact server mode against an engine without speculative decoding is checked in
test_spec_decode_equivalence.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.v1.structured_output.oracle import check_structured_output
from vllm import LLM, SamplingParams, StructuredOutputsParams

# Objects with long keys and enums: most of each output is forced.
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "document_category": {"enum": ["invoice", "receipt", "contract"]},
            "is_paid_in_full": {"type": "boolean"},
            "priority_level": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["document_category", "is_paid_in_full", "priority_level"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "shipping_country_code": {"enum": ["DE", "FR", "US"]},
            "customer_reference": {"type": "string", "maxLength": 4},
        },
        "required": ["shipping_country_code", "customer_reference"],
        "additionalProperties": False,
    },
]
CONSTRAINTS = [StructuredOutputsParams(json=s, disable_any_whitespace=True) for s in SCHEMAS]
CONSTRAINTS.append(StructuredOutputsParams(regex=r"status=(active|inactive);id=[0-9]{2}"))
NUM_PROMPTS = 6
THINK_END = 151668  # </think> in the demo vocabulary


def _params(mode: str | None, **extra: object) -> list[SamplingParams]:
    out = []
    for i in range(NUM_PROMPTS):
        so = dataclasses.replace(CONSTRAINTS[i % len(CONSTRAINTS)], fast_forward=mode)
        sampling = dict(temperature=0.0) if i % 2 else dict(temperature=0.9, seed=100 + i)
        if i == 3:
            sampling.update(logprobs=2)
        out.append(SamplingParams(max_tokens=64, structured_outputs=so, **sampling, **extra))
    return out


def _generate(llm: LLM, params: list[SamplingParams]) -> list:
    outs = llm.generate([f"Record {i}: reply in the format." for i in range(NUM_PROMPTS)],
                        params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _engine(async_scheduling: bool, **structured: object) -> LLM:
    return LLM("demo-tiny", max_model_len=256, max_num_seqs=NUM_PROMPTS,
               async_scheduling=async_scheduling,
               structured_outputs_config={"fast_forward": "canonical", **structured})


@pytest.fixture(scope="module")
def runs() -> dict[bool, dict]:
    """Per scheduling mode (async?): outputs by request mode, and the drafter's stats after
    the canonical run alone."""
    results = {}
    for async_scheduling in (False, True):
        llm = _engine(async_scheduling)
        try:
            stats = llm.llm_engine.engine_core.scheduler.drafter.stats
            by_mode: dict = {"canonical": _generate(llm, _params(None))}
            results[async_scheduling] = {"stats": stats.snapshot()}
            for mode in ("off", "exact"):
                by_mode[mode] = _generate(llm, _params(mode))
            results[async_scheduling]["outputs"] = by_mode
        finally:
            llm.shutdown()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_canonical_outputs_are_valid(runs: dict, async_scheduling: bool) -> None:
    from vllm.transformers_utils.tokenizer import get_tokenizer
    from vllm.model_executor.model_loader.demos import resolve_model_dir

    tokenizer = get_tokenizer(resolve_model_dir("demo-tiny"))
    outputs = runs[async_scheduling]["outputs"]["canonical"]
    for params, out in zip(_params(None), outputs, strict=True):
        assert out.finish_reason == "stop", out.text
        check_structured_output(params.structured_outputs, out, tokenizer)
    stats = runs[async_scheduling]["stats"]
    assert stats.num_forced_kept_tokens > 0
    # All but the one with logprobs, which never drafts (its forced tokens are pinned, one
    # per step).
    assert stats.num_fast_forwarded_requests == NUM_PROMPTS - 1
    if not async_scheduling:
        # A forced position allows only its canonical token: every forced draft is kept.
        assert stats.num_forced_kept_tokens == stats.num_forced_tokens


@pytest.mark.slow
def test_canonical_outputs_do_not_depend_on_scheduling(runs: dict) -> None:
    sync, async_ = runs[False]["outputs"]["canonical"], runs[True]["outputs"]["canonical"]
    assert [o.token_ids for o in async_] == [o.token_ids for o in sync]


@pytest.mark.slow
def test_canonical_outputs_survive_preemption(runs: dict) -> None:
    # 20 blocks of 4 tokens (one max_model_len, room for a prompt and max_tokens) cannot
    # hold 6 requests of ~20 tokens (the demo's tilted weights close JSON quickly).
    llm = LLM("demo-tiny", max_model_len=80, max_num_seqs=NUM_PROMPTS, async_scheduling=True,
              block_size=4, num_gpu_blocks_override=20, enable_prefix_caching=False,
              structured_outputs_config={"fast_forward": "canonical"})
    try:
        outputs = _generate(llm, _params(None))
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    want = runs[False]["outputs"]["canonical"]
    assert [o.token_ids for o in outputs] == [o.token_ids for o in want]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_exact_per_request_is_off(runs: dict, async_scheduling: bool) -> None:
    outputs = runs[async_scheduling]["outputs"]
    for exact, off in zip(outputs["exact"], outputs["off"], strict=True):
        assert exact.token_ids == off.token_ids
        if off.logprobs is not None:
            assert exact.logprobs == off.logprobs
    # Canonical spells forced text its own way: shorter than the random model's spelling.
    assert sum(map(len, (o.token_ids for o in outputs["canonical"]))) < sum(
        map(len, (o.token_ids for o in outputs["off"])))


@pytest.mark.slow
def test_exact_needs_only_bitmasks_so_a_compat_backend_has_it() -> None:
    """Exact mode reads nothing but bitmask rows, so every backend has it: on outlines,
    a request's exact outputs are its off outputs, and single-token runs were appended."""
    from tests.v1.engine.test_spec_decode_equivalence import FORCED_RUN

    llm = LLM("demo-tiny", max_model_len=256, max_num_seqs=4,
              structured_outputs_config={"fast_forward": "exact", "backend": "outlines"})
    prompts = [f"Record {i}: reply in the format." for i in range(4)]

    def generate(mode: str | None) -> list:
        params = [SamplingParams(max_tokens=32, structured_outputs=dataclasses.replace(
            FORCED_RUN, fast_forward=mode), **(dict(temperature=0.0) if i % 2 else dict(
                temperature=0.9, seed=7 + i))) for i in range(len(prompts))]
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    try:
        exact, off = generate(None), generate("off")
        stats = llm.llm_engine.engine_core.scheduler.drafter.stats
    finally:
        llm.shutdown()
    assert [o.token_ids for o in exact] == [o.token_ids for o in off]
    assert all(o.finish_reason == "stop" for o in exact)
    assert stats.num_forced_kept_tokens == stats.num_forced_tokens > 0


@pytest.mark.slow
def test_nothing_forced_enters_a_thinking_block() -> None:
    llm = _engine(False, reasoning_parser="deepseek_r1")
    scheduler = llm.llm_engine.engine_core.scheduler
    schedule = scheduler.schedule
    drafted_while_thinking: list[str] = []

    def recording_schedule():
        output = schedule()
        for req_id in output.scheduled_spec_decode_tokens:
            structured_req = scheduler.requests[req_id].structured_output_request
            if structured_req.thinking:
                drafted_while_thinking.append(req_id)
        return output

    scheduler.schedule = recording_schedule
    try:
        # A bias toward `</think>` ends some of the random model's thinking within the limit:
        # about the demo's own tilt toward quotes (some 18 logits on demo-tiny, see
        # demo_tilt.py), so sampled replies stop thinking now and then.
        bias = {THINK_END: 19.0}
        canonical = _generate(llm, _params(None, logit_bias=bias))
        off = _generate(llm, _params("off", logit_bias=bias))
        assert scheduler.drafter.stats.num_forced_kept_tokens > 0
    finally:
        llm.shutdown()
    assert drafted_while_thinking == []
    answered = 0
    for a, b in zip(canonical, off, strict=True):
        # Up to and including `</think>` (all of it when the thinking never ended).
        end = b.token_ids.index(THINK_END) + 1 if THINK_END in b.token_ids else len(b.token_ids)
        assert a.token_ids[:end] == b.token_ids[:end]
        answered += 1 < end < len(b.token_ids)
    assert answered > 0  # some replies thought, then answered
