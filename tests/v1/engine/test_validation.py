"""The admission rules (vllm/v1/engine/validation.py).

check_runner_inputs: one request's inputs must fit the runner's storage before the engine
core admits it (check_engine_request adds the adapter and SamplingParams.verify). The other
rules are the front end's (the offline LLM and the server share them). Each rule raises
InvalidRequestError naming the field."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from vllm.config import LoRAConfig
from vllm.exceptions import ErrorKind, InvalidRequestError, error_kind_of
from vllm.lora.request import LoRARequest, check_lora_enabled
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import validation
from vllm.v1.engine.validation import check_engine_request, check_runner_inputs

VOCAB = 1000
MAX_LEN = 32
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _params(**attrs: Any) -> SamplingParams:
    """Valid params with `attrs` set afterwards, past SamplingParams' own validation."""
    params = SamplingParams(max_tokens=4)
    for name, value in attrs.items():
        setattr(params, name, value)
    return params


def _check(prompt: list[Any] | None = None, **attrs: Any) -> None:
    check_runner_inputs([1, 2, 3] if prompt is None else prompt, _params(**attrs), VOCAB, MAX_LEN)


@pytest.mark.parametrize(
    "attrs",
    [
        {},
        {"top_k": 2**31 - 1},
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"seed": None, "max_tokens": None, "logprobs": None},
        {"min_tokens": 2**31 - 1},
        {"logprobs": VOCAB},
        {"temperature": FLOAT32_MAX},
        {"repetition_penalty": np.float64(1.5)},
        {"top_k": np.int64(5)},
        {"stop_token_ids": [2**63 - 1], "all_stop_token_ids": {0, 7}},
    ],
)
def test_values_the_runner_can_hold_pass(attrs: dict[str, Any]) -> None:
    _check(**attrs)


@pytest.mark.parametrize(
    "attrs, fragment",
    [
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": -(2**31) - 1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"seed": 2**63}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"min_tokens": 2**31}, "min_tokens"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"n": None}, "n"),
        ({"logprobs": VOCAB + 1}, "logprobs"),
        ({"temperature": 1e39}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("-inf")}, "min_p"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"presence_penalty": None}, "presence_penalty"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"all_stop_token_ids": {"x"}}, "all_stop_token_ids"),
    ],
)
def test_values_the_runner_cannot_hold_fail(attrs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        _check(**attrs)


@pytest.mark.parametrize(
    "prompt",
    [[], [0, VOCAB], [-1], [1] * MAX_LEN, [1, 2.0], [1, None]],
    ids=["empty", "past-vocab", "negative", "too-long", "float", "none"],
)
def test_prompts_the_runner_cannot_hold_fail(prompt: list[Any]) -> None:
    with pytest.raises(ValueError, match="prompt"):
        _check(prompt)


def test_prompt_edges_pass() -> None:
    _check([0, VOCAB - 1] + [5] * (MAX_LEN - 3))


def test_prompt_ids_outside_the_vocabulary_name_the_field() -> None:
    with pytest.raises(InvalidRequestError) as info:
        validation.check_prompt([1, VOCAB], VOCAB, MAX_LEN)
    assert info.value.param == "prompt_token_ids"
    assert error_kind_of(info.value) is ErrorKind.INVALID_REQUEST


@pytest.mark.parametrize(
    "num_prompt, max_tokens, fits",
    [(3, MAX_LEN - 3, True), (3, MAX_LEN - 2, False), (MAX_LEN - 1, 1, True),
     (MAX_LEN - 1, 2, False), (MAX_LEN - 1, None, True)],
)
def test_prompt_plus_max_tokens_must_fit(num_prompt: int, max_tokens: int | None,
                                         fits: bool) -> None:
    if fits:
        validation.check_fits(num_prompt, max_tokens, MAX_LEN)
        return
    with pytest.raises(InvalidRequestError, match="maximum context length") as info:
        validation.check_fits(num_prompt, max_tokens, MAX_LEN)
    assert info.value.param == "max_tokens"


@pytest.mark.parametrize(
    "attrs, param",
    [
        ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [0, VOCAB]}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[1, VOCAB + 2]]}, "bad_words"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ],
)
def test_token_ids_the_sampler_indexes_must_be_in_the_vocabulary(attrs: dict[str, Any],
                                                                 param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validation.check_token_ids(_params(**attrs), VOCAB)
    assert info.value.param == param


def test_more_allowed_token_ids_than_the_vocabulary_is_refused_before_any_is_read() -> None:
    ids = list(range(VOCAB)) + [0]
    with pytest.raises(InvalidRequestError, match=f"at most {VOCAB}") as info:
        validation.check_token_ids(_params(allowed_token_ids=ids), VOCAB)
    assert info.value.param == "allowed_token_ids"
    validation.check_token_ids(_params(allowed_token_ids=list(range(VOCAB))), VOCAB)


def test_token_ids_in_the_vocabulary_pass() -> None:
    validation.check_token_ids(
        _params(logit_bias={0: 1.0, VOCAB - 1: -1.0}, allowed_token_ids=[VOCAB - 1],
                bad_words_token_ids=[[0, VOCAB - 1]]),
        VOCAB,
    )


def test_stop_token_ids_must_be_in_the_vocabulary() -> None:
    validation.check_stop_token_ids(_params(stop_token_ids=[0, VOCAB - 1]), VOCAB)
    with pytest.raises(InvalidRequestError, match=f"{VOCAB} is outside") as info:
        validation.check_stop_token_ids(_params(stop_token_ids=[VOCAB]), VOCAB)
    assert info.value.param == "stop_token_ids"


def test_num_sequences_are_bounded() -> None:
    validation.check_num_sequences(4, 2, 8)
    with pytest.raises(InvalidRequestError, match="2 prompts x n=5 asks for 10") as info:
        validation.check_num_sequences(2, 5, 8)
    assert info.value.param == "n"


def test_a_constraint_must_be_structured_outputs_params() -> None:
    with pytest.raises(InvalidRequestError) as info:
        _check(structured_outputs={"json": {}})
    assert info.value.param == "structured_outputs"


def test_the_engine_also_runs_the_params_own_checks() -> None:
    check_engine_request([1, 2], _params(), None, VOCAB, MAX_LEN, None)
    with pytest.raises(InvalidRequestError, match="top_k"):
        check_engine_request([1, 2], _params(top_k=-5), None, VOCAB, MAX_LEN, None)


def test_an_adapter_needs_lora_enabled() -> None:
    lora = LoRARequest("a", 1, "/adapters/a")
    check_lora_enabled(None, None)
    check_lora_enabled(lora, LoRAConfig())
    with pytest.raises(InvalidRequestError, match="not enabled") as info:
        check_engine_request([1, 2], _params(), lora, VOCAB, MAX_LEN, None)
    assert info.value.param == "lora_request"


def test_priority_needs_the_priority_policy() -> None:
    validation.check_priority(0, "fcfs")
    validation.check_priority(-(2**63), "priority")
    for priority, policy in ((1, "fcfs"), (2**63, "priority"), (True, "priority"),
                             (1.5, "priority")):
        with pytest.raises(InvalidRequestError) as info:
            validation.check_priority(priority, policy)
        assert info.value.param == "priority"
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority"):
        validation.check_priority(-1, "fcfs")


@pytest.mark.parametrize("salt", ["", 7, b"salt"])
def test_a_cache_salt_is_a_non_empty_string(salt: object) -> None:
    validation.check_cache_salt(None)
    validation.check_cache_salt("tenant")
    with pytest.raises(InvalidRequestError) as info:
        validation.check_cache_salt(salt)
    assert info.value.param == "cache_salt"
