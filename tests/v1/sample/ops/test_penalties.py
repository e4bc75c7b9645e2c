"""Tests for vllm/v1/sample/ops/penalties.py against plain Python loops."""

from __future__ import annotations

import torch

from vllm.v1.sample.ops.penalties import apply_penalties, ban_tokens, pad_token_lists


def test_apply_penalties_matches_naive_loops() -> None:
    g = torch.Generator().manual_seed(0)
    n, vocab = 6, 30
    logits = torch.randn(n, vocab, generator=g) * 3
    prompts = [[1, 2, 2, 5], [0], [29, 3], [], [4, 4, 4], [7]]
    outputs = [[2, 2, 9], [], [3, 3, 3, 8], [1], [4, 10, 10], [7, 7]]
    rep = torch.tensor([1.5, 0.8, 1.0, 2.0, 1.2, 1.0])
    freq = torch.tensor([0.5, -0.3, 1.0, 0.0, 0.2, 2.0])
    pres = torch.tensor([0.1, 0.4, -1.0, 0.0, 1.5, 0.0])
    before = logits.clone()
    got = apply_penalties(
        logits,
        pad_token_lists(prompts, vocab, torch.device("cpu")),
        pad_token_lists(outputs, vocab, torch.device("cpu")),
        rep,
        freq,
        pres,
    )
    assert torch.equal(logits, before)
    for i in range(n):
        ref = logits[i].tolist()
        for t in set(prompts[i]) | set(outputs[i]):
            ref[t] = ref[t] / float(rep[i]) if ref[t] > 0 else ref[t] * float(rep[i])
        for t in set(outputs[i]):
            ref[t] -= float(freq[i]) * outputs[i].count(t) + float(pres[i])
        torch.testing.assert_close(got[i], torch.tensor(ref), rtol=1e-6, atol=1e-6)


def test_neutral_penalties_are_bit_identical() -> None:
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))
    logits[0, 3] = -float("inf")
    ids = pad_token_lists([[3, 3, 5], [1]], 16, torch.device("cpu"))
    got = apply_penalties(logits, ids, ids, torch.ones(2), torch.zeros(2), torch.zeros(2))
    assert torch.equal(got, logits)


def test_ban_tokens_and_padding() -> None:
    x = torch.zeros(2, 5)
    ban_tokens(x, [0, 1, 1], [4, 0, 2])
    assert torch.isinf(x).nonzero().tolist() == [[0, 4], [1, 0], [1, 2]]
    assert pad_token_lists([[1], [], [2, 3]], 9, torch.device("cpu")).tolist() == [
        [1, 9],
        [9, 9],
        [2, 3],
    ]
