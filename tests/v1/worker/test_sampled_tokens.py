"""Tests for vllm/v1/worker/sampled_tokens.py: a step's sampled ids split per request."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.v1.sample.sampler import LogprobsTensors
from vllm.v1.spec_decode.verify import NO_TOKEN
from vllm.v1.worker.sampled_tokens import AsyncOutput, SampledTokens, split_rows


def _reference(host: np.ndarray) -> list[list[int]]:
    """The per-element filter split_rows replaces."""
    return [[int(t) for t in row if t != NO_TOKEN] for row in host]


@pytest.mark.parametrize("width", [1, 2, 5])
def test_split_rows_keeps_each_rows_ids_in_order(width: int) -> None:
    rng = np.random.default_rng(width)
    host = rng.integers(0, 151_936, size=(64, width), dtype=np.int64)
    kept = rng.integers(1, width + 1, size=64)  # each row keeps at least its first id
    for row, n in enumerate(kept):
        host[row, n:] = NO_TOKEN
    got = split_rows(host)
    assert got == _reference(host)
    assert all(type(t) is int for row in got for t in row)


def test_split_rows_of_no_rows_and_of_a_row_without_ids() -> None:
    assert split_rows(np.zeros((0, 1), dtype=np.int64)) == []
    host = np.array([[NO_TOKEN], [7]], dtype=np.int64)
    assert split_rows(host) == [[], [7]]


def _sampled(req_ids: list[str], tokens: list[list[int]],
             logprobs: LogprobsTensors | None = None) -> SampledTokens:
    return SampledTokens(req_ids, [object() for _ in req_ids], [0] * len(req_ids),
                         torch.tensor(tokens, dtype=torch.int64), logprobs, None,
                         [[] for _ in req_ids])


def test_token_lists_are_split_once() -> None:
    sampled = _sampled(["a", "b"], [[5], [6]])
    first = sampled.token_lists()
    assert first == [[5], [6]]
    assert sampled.token_lists() is first


def test_output_rows_follow_req_ids_when_some_requests_did_not_sample() -> None:
    # "p" ran a partial prefill: it has an output row but no sample.
    lp = LogprobsTensors(torch.tensor([[5, 1], [6, 2]]), torch.tensor([[-0.5, -1.0],
                         [-0.25, -2.0]]), torch.tensor([1, 1]))
    out = AsyncOutput(["a", "p", "b"], ["a", "b"],
                      _sampled(["a", "b"], [[5, NO_TOKEN], [6, 9]], lp)).get_output()
    assert out.req_ids == ["a", "p", "b"]
    assert out.sampled_token_ids == [[5], [], [6, 9]]
    assert out.logprobs is not None
    assert out.logprobs.token_ids == [[5, 1], [], [6, 2]]
    assert out.logprobs.ranks == [1, 0, 1]


def test_output_of_a_step_where_every_request_sampled() -> None:
    out = AsyncOutput(["a", "b"], ["a", "b"], _sampled(["a", "b"], [[5], [6]])).get_output()
    assert out.req_ids == ["a", "b"] and out.sampled_token_ids == [[5], [6]]
    assert out.logprobs is None
