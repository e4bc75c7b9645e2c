"""Oracle: async scheduling gives exactly what synchronous scheduling gives.

For 20 prompts with greedy and seeded sampling, penalties and logprobs on some requests, and
0, 50 or 100 % structured requests, logit_bias, bad_words and allowed_token_ids on some
requests (and prompt_logprobs in a second batch), async/mp plain and with forced preemption,
async/uni with chunked prefill and forced preemption together, and sync/mp, must produce the
same tokens as sync/uni/plain, with logprobs within LOGPROB_TOLERANCE. Each special
condition is asserted to have happened.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tests.v1.structured_output.oracle import check_structured_output
from vllm import LLM, SamplingParams, StructuredOutputsParams

NUM_PROMPTS = 20
MAX_TOKENS = 20
RATIOS = (0.0, 0.5, 1.0)
# Tokens must match exactly; logprobs only to float32 precision. A log-softmax over ~150k
# logits of magnitude ~10 computed in another process (another thread count, other buffer
# alignment, so another reduction order in the BLAS kernels) differs by tens of ulps, which
# is ~1e-5 here (a CI machine measured 1.14e-5 between sync/uni and sync/mp). A logprob of
# the wrong row, position or token differs by orders of magnitude more.
LOGPROB_TOLERANCE = 1e-4
CONSTRAINTS = [
    StructuredOutputsParams(
        json={
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 99},
                "tag": {"enum": ["a", "b", "c"]},
            },
            "required": ["id", "tag"],
            "additionalProperties": False,
        },
        disable_any_whitespace=True,
    ),
    StructuredOutputsParams(regex=r"[a-z]{2,6}-[0-9]{1,3}"),
    StructuredOutputsParams(choice=["red", "green", "blue", "infrared"]),
    StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
    # xgrammar cannot bound the length of a pattern with a group, so the default `auto`
    # backend gives this one to llguidance: both backends run in every combination.
    StructuredOutputsParams(json={"type": "string", "pattern": "^(?:[a-z]+)$", "maxLength": 6}),
]


# Words the tiny demo model writes when left alone (so their bans change outputs).
BAD_WORDS = ["KeeperKeeper", "zeta zeta", "eta eta", "gamma gamma", "alpha beta"]


def _prompts() -> list[str]:
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    # Lengths up to ~40 tokens: longer than the chunked-prefill budget below.
    return [" ".join(rng.choices(words, k=rng.randint(2, 40))) for _ in range(NUM_PROMPTS)]


def _params(ratio: float) -> list[SamplingParams]:
    out = []
    num_structured = round(NUM_PROMPTS * ratio)
    for i in range(NUM_PROMPTS):
        kwargs = dict(max_tokens=MAX_TOKENS, ignore_eos=i % 3 == 0)
        if i % 2:
            kwargs.update(temperature=1.0, seed=1000 + i)
        else:
            kwargs.update(temperature=0.0)
        if i % 4 in (1, 2):
            kwargs.update(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3)
        if i % 4 in (0, 1):
            kwargs.update(logprobs=3)
        if i < num_structured:
            kwargs.update(structured_outputs=CONSTRAINTS[i % len(CONSTRAINTS)])
        # Token edits, structured or not: a bias, bad words (one banned only after the
        # token before it, which needs the newest tokens, still on the device under async)
        # and, on unconstrained rows, an allowed set.
        if i % 5 == 3:
            kwargs.update(logit_bias={i * 7 + 11: 4.0, 77233: -100})
        if i % 6 == 1:
            kwargs.update(bad_words=BAD_WORDS)
        if i % 7 == 5 and i >= num_structured:
            kwargs.update(allowed_token_ids=list(range(200, 1200, 3)))
        out.append(SamplingParams(**kwargs))
    return out


def condition_kwargs(condition: str) -> dict:
    """The engine arguments of a condition name, or of conditions joined by '-'."""
    return {k: v for name in condition.split("-") for k, v in CONDITIONS[name].items()}


CONDITIONS = {
    "plain": {},
    # 48 blocks of 4 tokens cannot hold 16 running requests of up to ~60 tokens.
    "preemption": dict(block_size=4, num_gpu_blocks_override=48, enable_prefix_caching=False),
    "chunked": dict(max_num_batched_tokens=16),
}


def generate_all(
    llm: LLM,
    ratios: tuple[float, ...] = RATIOS,
    prompts: Callable[[], list[str]] = _prompts,
    params_at: Callable[[float], list[SamplingParams]] = _params,
) -> dict[float, list]:
    """The workload (this module's, unless `prompts` and `params_at` give another) at every
    structured ratio of `ratios`, by ratio; checks every structured output and that the
    engine released every block and grammar afterwards."""
    results = {}
    for ratio in ratios:
        params = params_at(ratio)
        outs = llm.generate(prompts(), params, use_tqdm=False)
        for p, o in zip(params, outs):
            if p.structured_outputs is not None:
                check_structured_output(p.structured_outputs, o.outputs[0], llm.get_tokenizer())
        results[ratio] = [o.outputs[0] for o in outs]
    core = llm.llm_engine.engine_core
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert core.structured_output_manager.num_live_grammars == 0
    assert {b for b, _ in core.structured_output_manager.backend_choices()} == {
        "xgrammar", "guidance"
    }
    return results


def _run(async_scheduling: bool, executor: str, condition: str):
    llm = LLM(
        "demo-tiny",
        max_model_len=128,
        max_num_seqs=16,
        async_scheduling=async_scheduling,
        distributed_executor_backend=executor,
        **condition_kwargs(condition),
    )
    try:
        core = llm.llm_engine.engine_core
        deferred = []
        schedule = core.scheduler.schedule

        def recording_schedule():
            scheduler_output = schedule()
            deferred.append(scheduler_output.pending_structured_output_tokens)
            return scheduler_output

        core.scheduler.schedule = recording_schedule
        results = generate_all(llm)
        stats = {
            "preemptions": core.scheduler.num_preemptions,
            "deferred": any(deferred),
            "prompt_logprobs": _prompt_logprobs(llm),
        }
        return results, stats
    finally:
        llm.shutdown()


def _prompt_logprobs(llm: LLM) -> list:
    """prompt_logprobs of the workload's prompts (every other one structured), by request."""
    params = [SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2,
                             structured_outputs=CONSTRAINTS[0] if i % 2 else None)
              for i in range(NUM_PROMPTS)]
    return [o.prompt_logprobs for o in llm.generate(_prompts(), params, use_tqdm=False)]


def assert_same_prompt_logprobs(got: list, want: list) -> None:
    """The same scored tokens at every prompt position, logprobs within LOGPROB_TOLERANCE."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert len(a) == len(b) and a[0] is None and b[0] is None, i
        for la, lb in zip(a[1:], b[1:]):
            assert la.keys() == lb.keys(), i
            assert max(abs(la[k].logprob - lb[k].logprob) for k in lb) < LOGPROB_TOLERANCE, i


@pytest.fixture(scope="module")
def reference_run():
    return _run(False, "uni", "plain")


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run[0]


def assert_same(got, want, ratios: tuple[float, ...] = RATIOS) -> None:
    """Each ratio's outputs (from generate_all) have the same tokens, text and finish
    reasons as `want`'s, and logprobs within LOGPROB_TOLERANCE."""
    for ratio in ratios:
        for i, (a, b) in enumerate(zip(got[ratio], want[ratio], strict=True)):
            assert a.token_ids == b.token_ids, (ratio, i)
            assert a.text == b.text, (ratio, i)
            assert a.finish_reason == b.finish_reason, (ratio, i)
            if b.logprobs is not None:
                for la, lb in zip(a.logprobs, b.logprobs):
                    assert la.keys() == lb.keys(), (ratio, i)
                    worst = max(abs(la[k].logprob - lb[k].logprob) for k in lb)
                    assert worst < LOGPROB_TOLERANCE, (ratio, i)


@pytest.mark.slow
@pytest.mark.parametrize(
    "async_scheduling, executor, condition",
    # Synchronous runs are the reference: only the mp executor's plain run is compared (its
    # transport); preemption and chunking are compared where they can differ, async (on uni
    # in one run: chunking changes what is scheduled, not how it travels).
    [(False, "mp", "plain"), (True, "mp", "plain"), (True, "mp", "preemption"),
     (True, "uni", "chunked-preemption")],
)
def test_matches_sync_uniproc(reference_run, async_scheduling, executor, condition) -> None:
    got, stats = _run(async_scheduling, executor, condition)
    assert_same(got, reference_run[0])
    assert_same_prompt_logprobs(stats["prompt_logprobs"], reference_run[1]["prompt_logprobs"])
    if "preemption" in condition:
        assert stats["preemptions"] > 0
    if async_scheduling:
        # Structured requests decoding back to back must have deferred their sampling.
        assert stats["deferred"]
