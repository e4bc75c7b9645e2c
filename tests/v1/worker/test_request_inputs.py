"""check_request_inputs: one request's inputs must fit the runner's storage before admission."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from vllm.sampling_params import SamplingParams
from vllm.v1.worker.gpu_input_batch import check_request_inputs

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
    check_request_inputs([1, 2, 3] if prompt is None else prompt, _params(**attrs), VOCAB, MAX_LEN)


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
