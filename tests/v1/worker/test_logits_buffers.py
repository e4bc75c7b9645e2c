"""LogitsBuffers: pooled logits memory handed out and given back."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.worker.logits_buffers import LogitsBuffers


def test_buffers_are_reused_after_give_and_never_shared_while_lent() -> None:
    pool = LogitsBuffers(10)
    a = pool.take(3)
    b = pool.take(3)
    assert a.shape == (3, 10) and a.dtype == torch.float32 and a.is_contiguous()
    assert a.data_ptr() != b.data_ptr()
    pool.give(a)
    c = pool.take(2)  # fits in a's buffer (4 rows)
    assert c.data_ptr() == a.data_ptr() and c.shape == (2, 10)
    assert pool.num_lent == 2
    pool.give(b)
    pool.give(c)
    pool.give(c)  # twice: ignored
    pool.give(torch.empty(2, 10))  # not from the pool: ignored
    assert pool.num_lent == 0


def test_a_larger_batch_replaces_the_smallest_free_buffer() -> None:
    pool = LogitsBuffers(4)
    small = pool.take(2)
    pool.give(small)
    big = pool.take(5)  # capacity 8: the 2-row buffer cannot hold it
    assert big.shape == (5, 4) and big.data_ptr() != small.data_ptr()
    pool.give(big)
    again = pool.take(8)
    assert again.data_ptr() == big.data_ptr()


def test_bad_sizes_raise() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        LogitsBuffers(0)
    with pytest.raises(ValueError, match="rows"):
        LogitsBuffers(3).take(0)


def test_any_free_buffer_can_be_taken_whatever_the_order_of_the_pool() -> None:
    """The pool finds its buffers by identity: a buffer behind one of another size in the
    free list is taken without comparing tensors (which raised a shape mismatch)."""
    pool = LogitsBuffers(8)
    big, small = pool.take(16), pool.take(2)
    pool.give(big)
    pool.give(small)
    again = pool.take(2)  # the small buffer, second in the free list
    assert again.shape == (2, 8) and pool.num_lent == 1
    assert pool.take(9).shape == (9, 8)  # the big one, now first
    assert pool.num_lent == 2
