"""Tests for vllm/v1/spec_decode/verify.py: which drafts are kept, and that speculative
sampling keeps the target distribution exactly."""

from __future__ import annotations

import torch

from tests.v1.sample.goodness_of_fit import chi_square_test
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.verify import NO_TOKEN, verify_drafts, with_fast_forward


def test_keeps_matching_drafts_then_one_token() -> None:
    # Rows: a (no drafts) | b: drafts 7 1 | c: drafts 3 | d: drafts 4 4 4, all kept.
    sampled = torch.tensor([5, 7, 8, 9, 3, 4, 4, 4, 4, 2])
    tokens, last = verify_drafts(sampled, [1, 3, 2, 4], [[], [7, 1], [3], [4, 4, 4]])
    assert tokens.tolist() == [
        [5, NO_TOKEN, NO_TOKEN, NO_TOKEN],
        [7, 8, NO_TOKEN, NO_TOKEN],  # 7 kept, 1 rejected: the target's 8 replaces it
        [3, 4, NO_TOKEN, NO_TOKEN],  # 3 kept, then the token after it
        [4, 4, 4, 2],
    ]
    assert last.tolist() == [5, 8, 4, 2]


def test_fast_forward_tokens_fill_the_rows_that_sampled_nothing() -> None:
    # a: no drafts | b: drafts 7 1, the first a fast-forward token | c: drafts 3 4, both.
    sampled = torch.tensor([5, 1, 6, 9], dtype=torch.int32)  # a | b's rows 1, 2 | c's row 2
    full = with_fast_forward(sampled, [[], [7, 1], [3, 4]], [0, 1, 2])
    assert full.tolist() == [5, 7, 1, 6, 3, 4, 9]
    tokens, last = verify_drafts(full, [1, 3, 3], [[], [7, 1], [3, 4]])
    assert tokens.tolist() == [[5, NO_TOKEN, NO_TOKEN], [7, 1, 6], [3, 4, 9]]
    assert last.tolist() == [5, 6, 9]
    # Nothing skipped: the samples as they are.
    assert with_fast_forward(sampled, [[], [2], []], [0, 0, 0]) is sampled


def test_without_drafts_the_samples_are_the_output() -> None:
    sampled = torch.tensor([9, 0, 4], dtype=torch.int32)
    tokens, last = verify_drafts(sampled, [1, 1, 1], [[], [], []])
    assert tokens.dtype == last.dtype == torch.int64
    assert tokens.tolist() == [[9], [0], [4]] and last.tolist() == [9, 0, 4]


def test_first_draft_rejected_keeps_only_the_target_token() -> None:
    tokens, last = verify_drafts(torch.tensor([6, 1, 1]), [3], [[1, 1]])
    assert tokens.tolist() == [[6, NO_TOKEN, NO_TOKEN]] and last.tolist() == [6]


def test_speculative_sampling_keeps_the_target_distribution() -> None:
    """A Markov chain stands in for the target model; a proposer that always drafts the
    previous token twice is often wrong. Sampling 3 tokens per sequence with drafts (unseeded,
    through the real Sampler) must give the chain's joint distribution of those tokens."""
    vocab, num_seqs = 4, 12_000
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(vocab, vocab, generator=gen) + 0.2
    probs /= probs.sum(dim=1, keepdim=True)
    sampler = Sampler()
    sample_gen = torch.Generator().manual_seed(1)
    prev = torch.zeros(num_seqs, dtype=torch.int64)  # the prompt's last token
    out = torch.full((num_seqs, 3), -1, dtype=torch.int64)
    count = torch.zeros(num_seqs, dtype=torch.int64)
    kept_any = False
    while bool((count < 3).any()):
        live = (count < 3).nonzero().flatten()
        drafts = [[int(p)] * 2 for p in prev[live]]
        # Row j of a sequence is the target's distribution after its first j drafts, which
        # all equal the previous token.
        contexts = torch.stack([prev[live], prev[live], prev[live]], dim=1).flatten()
        logits = probs[contexts].log()
        metadata = SamplingMetadata.plain(
            torch.ones(len(contexts), dtype=torch.float32), sample_gen
        )
        sampled = sampler(logits, metadata).sampled_token_ids
        tokens, last = verify_drafts(sampled, [3] * len(live), drafts)
        start = count[live]
        for j in range(3):
            take = (tokens[:, j] != NO_TOKEN) & (start + j < 3)
            out[live[take], start[take] + j] = tokens[take, j]
            count[live[take]] += 1
        kept_any |= bool((tokens[:, 1] != NO_TOKEN).any())
        prev[live] = last
    assert kept_any
    joint = (probs[0][:, None, None] * probs[:, :, None] * probs[None, :, :])  # [t0, t1, t2]
    index = out[:, 0] * vocab * vocab + out[:, 1] * vocab + out[:, 2]
    counts = torch.bincount(index, minlength=vocab**3)
    result = chi_square_test(counts, joint.flatten())
    assert result.passed, str(result)
