"""allowed_token_ids, logit_bias and bad words on logits (vllm/v1/sample/ops/token_edits.py)."""

from __future__ import annotations

import torch

from vllm.v1.sample.ops.token_edits import add_bias, ban_completions, keep_only

NEG = float("-inf")


def test_keep_only_masks_every_other_token_of_the_listed_rows() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    keep_only(x, {0: [1, 3], 2: [0]})
    assert x[0].tolist() == [NEG, 1.0, NEG, 3.0]
    assert x[1].tolist() == [4.0, 5.0, 6.0, 7.0]  # untouched
    assert x[2].tolist() == [8.0, NEG, NEG, NEG]


def test_add_bias_adds_per_row() -> None:
    x = torch.zeros(2, 4)
    add_bias(x, {1: ([0, 3], [100.0, -2.5])})
    assert x[0].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert x[1].tolist() == [100.0, 0.0, 0.0, -2.5]


def test_ban_completions_bans_the_last_token_only_after_its_prefix() -> None:
    x = torch.zeros(3, 6)
    # Newest two output tokens per row, right-aligned (-1: no token yet).
    recent = torch.tensor([[4, 2], [2, 4], [-1, -1]])
    words = {
        0: [[4, 2, 5], [2, 1], [3, 3]],  # [4, 2] then 5 matches; [2] then 1 matches; 3 no
        1: [[4, 2, 5]],  # the prefix is there, in the wrong order
        2: [[2, 1]],  # nothing generated yet
    }
    ban_completions(x, words, recent)
    assert x[0].tolist() == [0.0, NEG, 0.0, 0.0, 0.0, NEG]
    assert x[1].tolist() == [0.0] * 6
    assert x[2].tolist() == [0.0] * 6


def test_a_token_two_words_end_in_is_banned_if_either_matches() -> None:
    x = torch.zeros(1, 4)
    ban_completions(x, {0: [[1, 3], [2, 3]]}, torch.tensor([[2]]))
    assert x[0].tolist() == [0.0, 0.0, 0.0, NEG]
