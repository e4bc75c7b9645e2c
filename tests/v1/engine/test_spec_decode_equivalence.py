"""Oracle: speculative decoding (n-gram, draft-model or EAGLE-3 drafts) changes no output token.

Greedy requests must give the tokens they give without drafts, and so must seeded random
ones (each kept token is the target's own sample at its position, and the seed mixes in the
position). The workload mixes greedy and seeded requests, requests that never draft
(penalties, logprobs), a stop string, and 0, 50 or 100 % structured requests (one constraint
forces runs of single-token positions, which exact fast-forward appends). The n-gram
proposer runs sync with forced preemption and async with chunked prefill and forced
preemption together on the uni executor, and async on mp (the sync mp transport is the async
one's; the scheduler tests cover sync chunking); the draft-model proposer (demo-tiny
drafting for itself) sync on uni, async on uni with chunked prefill, and async on mp with
forced preemption; an EAGLE-3 head (drafting in the runner) sync on uni and async on mp with
forced preemption (async on uni in the grammar-refused test below and in
tests/v1/spec_decode/test_eagle3_proposer.py; at k = 1 with every request constrained, async
on uni, in the last test below); with two pipeline stages, n-gram drafts with forced
preemption and grammar fast-forward. Every structured output must pass the grammar oracle,
and drafts must have been kept; under async scheduling some, of constrained requests too,
must have been drafted while the request's previous step was still in flight.
"""

from __future__ import annotations

import random
from unittest import mock

import pytest

from tests.v1.engine.test_async_sync_equivalence import (
    CONSTRAINTS,
    assert_same,
    condition_kwargs,
    generate_all,
)
import vllm.v1.structured_output.manager as structured_output
from vllm import LLM, SamplingParams, StructuredOutputsParams

NUM_PROMPTS = 16
MAX_TOKENS = 24
RATIOS = (0.0, 0.5, 1.0)
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    # The target drafting for itself: greedy drafts are kept, random ones mostly not.
    "draft": {"method": "draft_model", "model": "demo-tiny", "num_speculative_tokens": 3},
    # Grammar fast-forward: only what a constrained request's grammar forces is drafted.
    "grammar": {"method": "grammar", "num_speculative_tokens": 8},
}


# Text that the demo vocabulary spells one token per character, with no other token
# fitting: each of its positions allows a single token (exact fast-forward runs of six).
FORCED_RUN = StructuredOutputsParams(regex=r"[a-z]{1,3}=\^`\^`\^`")
SPEC_CONSTRAINTS = [*CONSTRAINTS, FORCED_RUN]


def _prompts() -> list[str]:
    rng = random.Random(1)
    words = "red green blue cyan magenta yellow".split()
    # Repetitive text: the lookup finds the latest words earlier in the prompt.
    return [" ".join(rng.choices(words, k=rng.randint(2, 6)) * rng.randint(2, 5))
            for _ in range(NUM_PROMPTS)]


def _params(ratio: float) -> list[SamplingParams]:
    out = []
    num_structured = round(NUM_PROMPTS * ratio)
    for i in range(NUM_PROMPTS):
        kwargs: dict = dict(max_tokens=MAX_TOKENS, ignore_eos=i % 3 != 2)
        if i % 4 == 1:
            kwargs.update(temperature=1.0, seed=2000 + i)
        elif i % 4 == 3:
            kwargs.update(temperature=0.8, top_k=20, seed=3000 + i)
        else:
            kwargs.update(temperature=0.0)
        if i == 2:
            kwargs.update(repetition_penalty=1.3, logprobs=2)  # never drafts
        if i < num_structured:
            kwargs.update(structured_outputs=SPEC_CONSTRAINTS[i % len(SPEC_CONSTRAINTS)])
        elif i % 4 == 0:
            kwargs.update(stop=["e"])  # may end inside a verification's kept tokens
        out.append(SamplingParams(**kwargs))
    return out


def _run(spec: str | None, async_scheduling: bool, executor: str, condition: str,
         ratios: tuple[float, ...] = RATIOS):
    """executor: "uni", "mp", or "pp2" (mp with two pipeline stages)."""
    llm = LLM(
        "demo-tiny",
        max_model_len=160,
        max_num_seqs=16,
        async_scheduling=async_scheduling,
        distributed_executor_backend="mp" if executor == "pp2" else executor,
        pipeline_parallel_size=2 if executor == "pp2" else 1,
        speculative_config=SPECS[spec] if spec else None,
        **condition_kwargs(condition),
    )
    try:
        scheduler = llm.llm_engine.engine_core.scheduler
        schedule = scheduler.schedule
        # Requests given drafts while a step of theirs was in flight (async: one step stale),
        # and which of them were constrained.
        stale: set[str] = set()
        stale_constrained: set[str] = set()

        def recording_schedule():
            in_flight = {r.request_id: r.use_structured_output
                         for r in scheduler.running if r.num_output_placeholders}
            scheduler_output = schedule()
            drafted = in_flight.keys() & scheduler_output.scheduled_spec_decode_tokens.keys()
            stale.update(drafted)
            stale_constrained.update(r for r in drafted if in_flight[r])
            return scheduler_output

        # Draft lists whose grammar, at sampling, rejected a draft: they assumed tokens in
        # flight that did not come.
        refuted = [0]
        # Every constrained request's drafts as its bitmask rows were made.
        constrained_drafts: list[list[int]] = []
        fill_draft_rows = structured_output.fill_draft_rows

        def recording_fill_draft_rows(req_id, grammar, drafts, bitmask, first):
            refuted[0] += len(grammar.validate_tokens(drafts)) < len(drafts)
            constrained_drafts.append(list(drafts))
            fill_draft_rows(req_id, grammar, drafts, bitmask, first)

        scheduler.schedule = recording_schedule
        with mock.patch.object(structured_output, "fill_draft_rows",
                               recording_fill_draft_rows):
            results = generate_all(llm, ratios, _prompts, _params)
        return results, scheduler, stale, stale_constrained, refuted[0], constrained_drafts
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def reference():
    return _run(None, False, "uni", "plain")[0]


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory):
    """An EAGLE-3 head for demo-tiny (original layout, over the first 32000 token ids) that
    mostly drafts the target's own prediction at the position before, so that runs of one
    token keep its drafts; its layer adds a little noise, so other drafts are rejected."""
    from transformers import AutoConfig

    from tests.utils_eagle3 import write_eagle3_head
    from vllm.model_executor.model_loader.demos import resolve_model_dir

    target = resolve_model_dir("demo-tiny")
    head = write_eagle3_head(tmp_path_factory.mktemp("eagle3"), AutoConfig.from_pretrained(target),
                             aux_layer_ids=[0, 1, 2], draft_vocab=list(range(32000)),
                             echo=target, scale=0.002)
    SPECS["eagle3"] = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    yield
    del SPECS["eagle3"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec, async_scheduling, executor, condition",
    # Each plain (prefix-cached, unpreempted) run on uni is a subset of a preempted or
    # chunked one beside it, so only mp keeps a plain case; every method runs sync and async.
    [
        ("ngram", True, "mp", "plain"),
        ("ngram", False, "uni", "preemption"),
        ("ngram", True, "uni", "chunked-preemption"),
        ("draft", False, "uni", "chunked"),
        ("draft", True, "uni", "chunked"),
        ("draft", True, "mp", "preemption"),
        ("ngram", True, "pp2", "preemption"),
        ("eagle3", False, "uni", "plain"),
        ("eagle3", True, "mp", "preemption"),
    ],
)
def test_drafts_change_no_output(reference, request, spec, async_scheduling, executor,
                                 condition) -> None:
    if spec == "eagle3":
        request.getfixturevalue("eagle3_head")
    got, scheduler, stale, stale_constrained, refuted, _ = _run(
        spec, async_scheduling, executor, condition)
    assert_same(got, reference, RATIOS)
    # Async: drafting requests, constrained ones too, do not wait for their previous step's
    # tokens. Pipeline stages run a request in one batch at a time, so they never draft
    # ahead of a step in flight.
    overlapped = async_scheduling and executor != "pp2"
    assert bool(stale) == overlapped
    assert bool(stale_constrained) == overlapped
    # Some of those stale constrained drafts turned out wrong for the grammar (the outputs
    # above stay exact); drafts made with every token known never are. The draft model's
    # constrained drafts are mostly what the grammar allows alone (the random model's own
    # guesses rarely pass the grammar), so only the lookup's are sure to be refuted now and
    # then.
    if spec == "ngram" or not overlapped:
        assert bool(refuted) == overlapped
    assert scheduler.drafter.stats.num_accepted_tokens > 0
    assert scheduler.drafter.stats.num_draft_tokens > scheduler.drafter.stats.num_accepted_tokens  # random rows reject
    if "preemption" in condition:
        assert scheduler.num_preemptions > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "async_scheduling, executor, condition",
    [(False, "uni", "plain"), (True, "mp", "preemption"), (True, "pp2", "plain")],
)
def test_fast_forward_changes_no_output(reference, async_scheduling, executor, condition) -> None:
    """Grammar fast-forward (exact) appends only tokens that their position allows alone,
    for constrained requests only, never sampled, and the outputs are exactly those
    without it; every one of them is kept."""
    got, scheduler, stale, stale_constrained, _, _ = _run(
        "grammar", async_scheduling, executor, condition)
    assert_same(got, reference, RATIOS)
    stats = scheduler.drafter.stats
    assert stats.num_accepted_tokens > 0
    assert stats.num_forced_kept_tokens == stats.num_forced_tokens == stats.num_draft_tokens
    assert stale == stale_constrained  # unconstrained requests never draft
    if condition == "preemption":
        assert scheduler.num_preemptions > 0


@pytest.mark.slow
def test_grammar_refused_drafts_change_no_output(reference, tmp_path, monkeypatch) -> None:
    """An EAGLE-3 head that only ever drafts <|im_start|>, which no constraint allows: under
    async scheduling, with half the requests constrained, the outputs are those without
    drafts, and no constrained request ever verifies that token (its drafts stop before the
    first token its grammar refuses), while the unconstrained ones do."""
    from transformers import AutoConfig

    from tests.utils_eagle3 import write_eagle3_head
    from vllm.model_executor.model_loader.demos import resolve_model_dir

    refused = 151_644  # <|im_start|>
    target = AutoConfig.from_pretrained(resolve_model_dir("demo-tiny"))
    head = write_eagle3_head(tmp_path / "head", target, aux_layer_ids=[0, 1, 2],
                             draft_vocab=[refused])
    monkeypatch.setitem(SPECS, "refused", {"method": "eagle3", "model": str(head),
                                           "num_speculative_tokens": 3})
    got, scheduler, _, _, _, constrained_drafts = _run("refused", True, "uni", "plain",
                                                       ratios=(0.5,))
    assert_same(got, reference, (0.5,))
    assert constrained_drafts  # forced tokens were drafted and verified
    assert not any(refused in drafts for drafts in constrained_drafts)
    stats = scheduler.drafter.stats
    assert stats.num_draft_tokens > stats.num_forced_tokens  # the head drafted too
    assert stats.num_accepted_tokens == stats.num_forced_kept_tokens  # and none was kept


@pytest.mark.slow
def test_constrained_requests_get_head_drafts_at_k1_under_async(eagle3_head) -> None:
    """One EAGLE-3 draft per step (k = 1) under async scheduling, every request constrained
    (a regex any text meets, so the grammar refuses none of the head's drafts): a
    constrained request drafts from the head's drafts one step stale, which must reach past
    the in-flight step's draft and sample, so the head drafts further for such steps. The
    head's drafts are verified and some kept, and the outputs are those without drafts."""
    anything = StructuredOutputsParams(regex=r"[\s\S]*")
    params = [SamplingParams(max_tokens=16, ignore_eos=True, structured_outputs=anything,
                             **({"temperature": 0.0} if i % 2 else {"temperature": 1.0,
                                                                     "seed": 40 + i}))
              for i in range(4)]
    prompts = _prompts()[:4]
    spec = {**SPECS["eagle3"], "num_speculative_tokens": 1}
    results = []
    for speculative_config in (None, spec):
        llm = LLM("demo-tiny", max_model_len=160, max_num_seqs=4, async_scheduling=True,
                  speculative_config=speculative_config)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            stats = llm.llm_engine.engine_core.scheduler.drafter.stats
        finally:
            llm.shutdown()
        results.append([list(o.outputs[0].token_ids) for o in outs])
    assert results[1] == results[0]
    assert stats.num_forced_tokens == 0
    assert stats.num_accepted_tokens > 0
