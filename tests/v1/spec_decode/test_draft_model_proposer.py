"""Tests for vllm/v1/spec_decode/draft_model_proposer.py: greedy drafts of a small model,
computed incrementally over a per-request cache row."""

from __future__ import annotations

import pytest
import torch

from tests.utils_models import build_checkpoint
from vllm.model_executor.greedy_decode_loop import BareDecoder
from vllm.model_executor.model_loader.demo_model import build_demo_model
from vllm.v1.spec_decode.draft_model_proposer import DraftModelProposer

VOCAB = 151_936  # the demo models' vocabulary


@pytest.fixture(scope="module")
def draft_dir():
    return build_demo_model("demo-tiny")


def _proposer(draft_dir, rows: int = 4, k: int = 3) -> DraftModelProposer:
    return DraftModelProposer(draft_dir, k, rows, 64, VOCAB, torch.device("cpu"), torch.float32)


def _greedy(draft_dir, tokens: list[int], n: int) -> list[int]:
    return BareDecoder(draft_dir).generate([tokens], n)[0]


def test_drafts_are_the_draft_models_greedy_tokens_step_after_step(draft_dir) -> None:
    proposer = _proposer(draft_dir)
    a, b = [11, 12, 13, 14, 11, 12], [500, 7, 500, 7, 500]
    got = proposer.propose_batch({"a": (a, len(a), 3), "b": (b, len(b), 2)})
    assert got == {"a": _greedy(draft_dir, a, 3), "b": _greedy(draft_dir, b, 2)}
    # The next step computes the new tokens of both in one forward (a's two, b's one, so b
    # recomputes one cached token); the drafts' cache slots are overwritten.
    a2, b2 = a + [99, 98], b + [7]
    again = proposer.propose_batch({"a": (a2, len(a2), 3), "b": (b2, len(b2), 3)})
    assert again == {"a": _greedy(draft_dir, a2, 3), "b": _greedy(draft_dir, b2, 3)}
    # Many new tokens at once (more than 3k + 2) are computed on their own.
    a3 = a2 + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    assert proposer.propose_batch({"a": (a3, len(a3), 2)}) == {"a": _greedy(draft_dir, a3, 2)}


def test_stale_contexts_catch_up_in_one_forward(draft_dir, monkeypatch) -> None:
    """Async scheduling proposes one step stale: since a request's previous proposal come
    that step's kept tokens (up to k + 1), the k drafts in flight and, for a constrained
    request, the tokens its grammar forces after them (up to k + 1). Such requests must
    still catch up together, in one forward, not one forward each."""
    proposer = _proposer(draft_dir, k=3)
    calls: list[int] = []
    catch_up = proposer._catch_up

    def counting(ids, token_lists, start, width=0):
        calls.append(len(ids))
        return catch_up(ids, token_lists, start, width)

    monkeypatch.setattr(proposer, "_catch_up", counting)
    contexts = {r: [r + j for j in range(1, 9)] for r in range(0, 40, 10)}
    proposer.propose_batch({r: (t, len(t), 4) for r, t in contexts.items()})
    calls.clear()
    # 4 kept tokens confirmed, then 3 drafts in flight and 4 forced tokens: 11 new each.
    grown = {r: t + [t[0]] * 4 + [t[1]] * 3 + [t[2]] * 4 for r, t in contexts.items()}
    got = proposer.propose_batch({r: (t, len(t) - 7, 4) for r, t in grown.items()})
    assert calls == [len(grown)]
    assert got == {r: _greedy(draft_dir, t, 4) for r, t in grown.items()}


def test_provisional_tokens_are_not_kept_as_cached(draft_dir) -> None:
    proposer = _proposer(draft_dir)
    a = [21, 22, 23]
    # Two forced tokens after three confirmed ones; then the request confirms others.
    proposer.propose_batch({"a": (a + [5, 6], 3, 2)})
    later = a + [7, 8]
    assert proposer.propose_batch({"a": (later, 5, 2)}) == {"a": _greedy(draft_dir, later, 2)}


def test_rows_are_reused_after_release_and_limits_hold(draft_dir) -> None:
    proposer = _proposer(draft_dir, rows=1)
    assert len(proposer.propose_batch({"a": ([1, 2, 3], 3, 2)})["a"]) == 2
    # Every row taken: the other request gets no drafts, and nothing fails.
    assert proposer.propose_batch({"b": ([4, 5], 2, 2)}) == {}
    proposer.release("a")
    proposer.release("unknown")
    b = [4, 5]
    assert proposer.propose_batch({"b": (b, 2, 1)}) == {"b": _greedy(draft_dir, b, 1)}
    assert proposer.propose_batch({"b": (b + [6], 3, 0)}) == {}


def test_a_draft_model_with_another_vocabulary_is_refused(tmp_path) -> None:
    build_checkpoint("qwen3", tmp_path, seed=1)  # 512 tokens
    with pytest.raises(ValueError, match="vocabulary has 512 tokens, the target's 151936"):
        DraftModelProposer(tmp_path, 3, 2, 64, VOCAB, torch.device("cpu"), torch.float32)


def test_a_cache_that_does_not_fit_is_an_error_naming_its_size(draft_dir) -> None:
    rows, tokens = 8, 2**36
    size = BareDecoder(draft_dir).cache_bytes(rows, tokens)
    assert size == sum(t.numel() * t.element_size()
                       for t in BareDecoder(draft_dir).new_cache(2, 3)) * rows * tokens // 6
    with pytest.raises(ValueError, match=rf"{rows} rows of {tokens} tokens, {size / 2**30:.1f} "
                                         r"GiB.*lower --max-num-seqs or --max-model-len"):
        DraftModelProposer(draft_dir, 3, rows, tokens, VOCAB, torch.device("cpu"),
                           torch.float32)


def test_a_request_near_max_model_len_drafts_beside_a_longer_limit(draft_dir) -> None:
    proposer = _proposer(draft_dir, k=5)  # 64 slots per row
    near = [3] * 62  # one draft fits before max_model_len
    far = [4, 5, 6]
    # The batch decodes four more times for `far`; `near` must not write past its row.
    got = proposer.propose_batch({"near": (near, 62, 1), "far": (far, 3, 5)})
    assert got == {"near": _greedy(draft_dir, near, 1), "far": _greedy(draft_dir, far, 5)}
