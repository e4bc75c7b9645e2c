"""Tests for vllm/v1/spec_decode/ngram_proposer.py."""

from __future__ import annotations

import pytest

from vllm.v1.spec_decode.ngram_proposer import NgramProposer


def test_longest_suffix_wins_and_its_latest_occurrence() -> None:
    p = NgramProposer(min_n=1, max_n=3, num_tokens=3)
    # Suffix "1 2" last occurred at the start, followed by 3 4 1.
    assert p.propose([1, 2, 3, 4, 1, 2]) == [3, 4, 1]
    # "9 1 2" is longer than "1 2" and points elsewhere.
    assert p.propose([9, 1, 2, 7, 1, 2, 8, 9, 1, 2]) == [7, 1, 2]
    # Only a 1-gram matches: its latest earlier occurrence with three tokens after it.
    assert p.propose([5, 6, 1, 5, 7, 8, 9, 5]) == [7, 8, 9]
    # No occurrence has a full continuation: the earliest, whose continuation is longest.
    assert p.propose([5, 6, 5, 7, 5]) == [6, 5, 7]


def test_a_run_of_one_token_drafts_in_full() -> None:
    p = NgramProposer(min_n=1, max_n=4, num_tokens=3)
    assert p.propose([9] * 8) == [9, 9, 9]
    # The longest suffix wins even where a shorter one would draft more.
    assert p.propose([9] * 6) == [9, 9]
    assert p.propose([9] * 3) == [9]


def test_no_match_short_input_and_limits() -> None:
    p = NgramProposer(min_n=2, max_n=4, num_tokens=5)
    assert p.propose([1, 2, 3, 4]) == []
    assert p.propose([1, 2]) == []
    assert p.propose([1, 2, 3, 1, 2], max_tokens=1) == [3]
    assert p.propose([1, 2, 3, 1, 2], max_tokens=0) == []
    # A draft never reaches past the tokens that exist.
    assert p.propose([1, 2, 1, 2]) == [1, 2]


@pytest.mark.parametrize("args", [(0, 2, 1), (3, 2, 1), (1, 2, 0)])
def test_bad_settings_are_refused(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="NgramProposer"):
        NgramProposer(*args)
