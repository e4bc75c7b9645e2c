"""Oracle for `thinking_token_budget` (vllm/reasoning/budget.py).

demo-think is scripted: after the chat prompt it writes `<think>`, a thought of a known
number of tokens, `</think>`, a blank line and `<tool_call>`. With the qwen3 parser a budget
N below the thought's length must give exactly the thought's first N tokens, then `</think>`,
then the answer (which follows its constraint); a budget at or above the length changes
nothing; budget 0 closes the block at once. Greedy and seeded outputs must be the same
synchronously, with async scheduling, with n-gram drafts, with exact fast-forward, and with
two pipeline stages on the mp executor.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from vllm import LLM, SamplingParams, StructuredOutputsParams
from vllm.exceptions import InvalidRequestError
from vllm.model_executor.model_loader.demo_scripted import SCRIPT
from vllm.reasoning import ReasoningParser, ReasoningState
from vllm.reasoning.budget import ThinkingBudget
from vllm.v1.core.sched.postprocess import only_tokens

THOUGHT = SCRIPT[SCRIPT.index("<think>") + 1:SCRIPT.index("</think>")]
MESSAGES = [{"role": "user", "content": "Answer with a digit."}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
BUDGETS = (0, 3, len(THOUGHT) - 1, len(THOUGHT), len(THOUGHT) + 5, None)

# ------------------------------------------------------------------ units


def test_budget_counts_tokens_inside_the_block_only() -> None:
    parser = ReasoningParser("t", False, 1, 2, [9])
    budget = ThinkingBudget.start(parser, 2, [9])
    assert budget.state == ReasoningState.UNDECIDED and budget.active
    assert not budget.must_end and budget.may_run_out(2) and not budget.may_run_out(1)
    budget.advance(1)  # <think>: opens the block, not counted
    assert budget.state == ReasoningState.THINKING and budget.spent == 0
    budget.advance(5)
    assert not budget.must_end and budget.may_run_out(1)
    budget.advance(6)
    assert budget.must_end and budget.spent == 2
    budget.advance(2)  # </think>: closes it, not counted
    assert not budget.active and not budget.must_end and not budget.may_run_out(10)
    assert budget.spent == 2


def test_a_reply_that_does_not_think_never_runs_out() -> None:
    budget = ThinkingBudget.start(ReasoningParser("t", False, 1, 2, [9]), 0, [9])
    budget.advance(7)
    assert budget.state == ReasoningState.ENDED and not budget.must_end


@pytest.mark.parametrize("token", [0, 5, 31, 32, 63, 100])
def test_only_tokens_rows_allow_exactly_one_token(token: int) -> None:
    rows = only_tokens([token, 3], 4)
    bits = np.unpackbits(rows.view(np.uint8), bitorder="little").reshape(2, -1)
    assert np.flatnonzero(bits[0]).tolist() == [token]
    assert np.flatnonzero(bits[1]).tolist() == [3]


def test_negative_budget_is_refused_by_name() -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(thinking_token_budget=-1)
    assert e.value.param == "thinking_token_budget"


# ------------------------------------------------------------------ engines

ENGINES = {
    "sync": dict(async_scheduling=False),
    "async": dict(async_scheduling=True),
    "async+ngram": dict(async_scheduling=True, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}),
    # Exact fast-forward drafts the answer's forced tokens (outputs unchanged).
    "async+ff": dict(async_scheduling=True, structured_outputs_config={"fast_forward": "exact"}),
    "pp2": dict(async_scheduling=True, pipeline_parallel_size=2,
                distributed_executor_backend="mp"),
}


def _params(budget: int | None, constrained: bool, seeded: bool) -> SamplingParams:
    kwargs: dict = dict(max_tokens=40, thinking_token_budget=budget)
    kwargs.update(temperature=0.8, seed=11) if seeded else kwargs.update(temperature=0.0)
    if constrained:
        kwargs["structured_outputs"] = StructuredOutputsParams(json=SCHEMA)
    return SamplingParams(**kwargs)


def _workload() -> list[SamplingParams]:
    return [_params(b, c, s) for b in BUDGETS for c in (False, True) for s in (False, True)]


def _run(name: str) -> list[list[int]]:
    llm = LLM("demo-think", max_model_len=512, max_num_seqs=8, reasoning_parser="qwen3",
              **ENGINES[name])
    try:
        outputs = llm.chat([MESSAGES] * len(_workload()), _workload(), use_tqdm=False)
        tokenizer = llm.llm_engine.processor.tokenizer
        vocab = {t: tokenizer.encode(t, add_special_tokens=False)[0] for t in SCRIPT}
    finally:
        llm.shutdown()
    _check(outputs, vocab)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _check(outputs: list, vocab: dict[str, int]) -> None:
    """(`vocab`: each scripted piece's token id.) Each output thinks exactly min(budget, thought) tokens of the thought, closes the
    block, then answers; a constrained answer that stopped validates."""
    start, end = vocab["<think>"], vocab["</think>"]
    thought = [vocab[t] for t in THOUGHT]
    for params, out in zip(_workload(), outputs):
        ids = list(out.outputs[0].token_ids)
        budget = params.thinking_token_budget
        kept = len(thought) if budget is None else min(budget, len(thought))
        assert ids[0] == start, ids
        assert ids[1:kept + 1] == thought[:kept], (budget, ids)
        assert ids[kept + 1] == end, (budget, ids)
        if params.structured_outputs is None:
            # The model's own successor of </think>, whoever wrote it.
            assert ids[kept + 2] == vocab["\n\n"]
        elif out.outputs[0].finish_reason == "stop":
            answer = out.outputs[0].text.split("</think>", 1)[1]
            jsonschema.validate(json.loads(answer), SCHEMA)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return _run("sync")


@pytest.mark.parametrize("name", ["async", "async+ngram", "async+ff",
                                  pytest.param("pp2", marks=pytest.mark.slow)])
def test_budget_outputs_are_the_same_under_every_engine(reference, name: str) -> None:
    assert _run(name) == reference


def test_budget_needs_a_reasoning_parser() -> None:
    llm = LLM("demo-think", max_model_len=256, max_num_seqs=2)
    try:
        with pytest.raises(InvalidRequestError) as e:
            llm.chat(MESSAGES, SamplingParams(thinking_token_budget=2), use_tqdm=False)
        assert e.value.param == "thinking_token_budget"
        assert "--reasoning-parser" in e.value.message
    finally:
        llm.shutdown()
