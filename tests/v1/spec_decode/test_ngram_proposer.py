"""Tests for vllm/v1/spec_decode/ngram_proposer.py."""

from __future__ import annotations

import random

import pytest

from vllm.v1.spec_decode.ngram_proposer import NgramProposer


def _propose(p: NgramProposer, tokens: list[int], max_tokens: int | None = None) -> list[int]:
    """One stateless lookup through propose_batch: up to min(num_tokens, max_tokens) drafts
    to follow `tokens`, all confirmed; the request is released so no buffer carries over."""
    k = p.num_tokens if max_tokens is None else min(p.num_tokens, max_tokens)
    try:
        return p.propose_batch({"r": (tokens, len(tokens), k)}).get("r", [])
    finally:
        p.release("r")


def test_longest_suffix_wins_and_its_latest_occurrence() -> None:
    p = NgramProposer(min_n=1, max_n=3, num_tokens=3)
    # Suffix "1 2" last occurred at the start, followed by 3 4 1.
    assert _propose(p, [1, 2, 3, 4, 1, 2]) == [3, 4, 1]
    # "9 1 2" is longer than "1 2" and points elsewhere.
    assert _propose(p, [9, 1, 2, 7, 1, 2, 8, 9, 1, 2]) == [7, 1, 2]
    # Only a 1-gram matches: its latest earlier occurrence with three tokens after it.
    assert _propose(p, [5, 6, 1, 5, 7, 8, 9, 5]) == [7, 8, 9]
    # The latest occurrence lacks a full continuation: an earlier one has it.
    assert _propose(p, [5, 6, 5, 7, 5]) == [6, 5, 7]


def test_a_run_of_one_token_drafts_in_full() -> None:
    p = NgramProposer(min_n=1, max_n=4, num_tokens=3)
    assert _propose(p, [9] * 8) == [9, 9, 9]
    # No occurrence of the longest suffix is followed by three tokens: the latest one is
    # continued with the run's period (1).
    assert _propose(p, [9] * 6) == [9, 9, 9]
    assert _propose(p, [9] * 3) == [9, 9, 9]


def test_no_match_short_input_and_limits() -> None:
    p = NgramProposer(min_n=2, max_n=4, num_tokens=5)
    assert _propose(p, [1, 2, 3, 4]) == []
    assert _propose(p, [1, 2]) == []
    assert _propose(p, [1, 2, 3, 1, 2], max_tokens=1) == [3]
    assert _propose(p, [1, 2, 3, 1, 2], max_tokens=0) == []
    # Past the tokens that exist, the copy repeats with the match's period (2 here).
    assert _propose(p, [1, 2, 1, 2]) == [1, 2, 1, 2, 1]
    assert _propose(p, [3, 1, 2, 4, 1, 2]) == [4, 1, 2, 4, 1]


@pytest.mark.parametrize("args", [(0, 2, 1), (3, 2, 1), (1, 2, 0)])
def test_bad_settings_are_refused(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="NgramProposer"):
        NgramProposer(*args)


def _reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule in plain Python: the longest suffix (max_n down to min_n) that occurs
    earlier; the k tokens after its latest occurrence with k tokens after it, else the
    tokens after its latest occurrence, extended by copying each drafted token from `period`
    places back."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        starts = [s for s in range(length - n) if tokens[s : s + n] == suffix]
        if starts:
            full = [s for s in starts if s + n + k <= length]
            start = (full[-1] if full else starts[-1]) + n
            extended = list(tokens)
            for i in range(k):
                if start + i >= len(extended):
                    extended.append(extended[start + i - (length - start)])
            return extended[start : start + k]
    return []


@pytest.mark.parametrize("seed", range(30))
def test_lookup_matches_the_rule_on_random_tokens(seed: int) -> None:
    rng = random.Random(seed)
    min_n = rng.randint(1, 3)
    max_n = rng.randint(min_n, 5)
    k = rng.randint(1, 5)
    p = NgramProposer(min_n, max_n, k)
    vocab = rng.choice([2, 3, 5, 20])  # small vocabularies repeat, as repetitive text does
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
    for end in range(len(tokens) + 1):
        prefix = tokens[:end]
        want = _reference(prefix, min_n, max_n, k) if end > min_n else []
        assert _propose(p, prefix) == want, (prefix, min_n, max_n, k)


def test_batched_lookups_follow_growing_confirmed_tokens() -> None:
    """propose_batch keeps each request's confirmed tokens between calls; provisional tokens
    (past the confirmed count) are used once and not kept."""
    rng = random.Random(7)
    p = NgramProposer(1, 3, 3)
    tokens = [rng.randrange(4) for _ in range(5)]
    for step in range(80):
        tokens.append(rng.randrange(4))
        forced = [rng.randrange(4) for _ in range(step % 3)]
        context = tokens + forced
        got = p.propose_batch({"a": (context, len(tokens), 2)})
        want = _reference(context, 1, 3, 2)
        assert got == ({"a": want} if want else {}), step
    p.release("a")
    # After release the id starts over with other tokens.
    assert p.propose_batch({"a": ([5, 7, 5], 3, 3)}) == {"a": [7, 5, 7]}
