"""Tests for vllm/v1/core/kv_cache_utils.py: block hashes and the free block queue."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from vllm.v1.core.kv_cache_utils import FreeBlockQueue, KVCacheBlock, hash_block_tokens


def _ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue.blocks()]


def _check_links(queue: FreeBlockQueue, expected: list[int]) -> None:
    """The queue holds exactly `expected` in order, forward and backward links agree."""
    blocks = queue.blocks()
    assert [b.block_id for b in blocks] == expected
    assert len(queue) == queue.num_free == len(expected)
    for prev, nxt in zip(blocks, blocks[1:]):
        assert prev.next_free is nxt and nxt.prev_free is prev


def test_hash_is_chained_and_content_sensitive() -> None:
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(root, int)
    assert root == hash_block_tokens(None, (1, 2, 3, 4))  # any sequence type
    assert root != hash_block_tokens(None, [1, 2, 4, 3])
    assert root != hash_block_tokens(None, [1, 2, 3])
    child = hash_block_tokens(root, [5, 6, 7, 8])
    assert child == hash_block_tokens(root, [5, 6, 7, 8])
    # Same tokens under a different parent (or at the root) are a different block.
    assert child != hash_block_tokens(None, [5, 6, 7, 8])
    other_root = hash_block_tokens(None, [9, 2, 3, 4])
    assert child != hash_block_tokens(other_root, [5, 6, 7, 8])


def test_hash_is_the_same_in_other_processes() -> None:
    code = ("from vllm.v1.core.kv_cache_utils import hash_block_tokens as h\n"
            "r = h(None, [1, 2, 3]); print(r, h(r, [4, 5, 6]))")
    here_root = hash_block_tokens(None, [1, 2, 3])
    expected = f"{here_root} {hash_block_tokens(here_root, [4, 5, 6])}"
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                             capture_output=True, text=True).stdout.strip()
        assert out == expected


def test_queue_popleft_append_remove() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    _check_links(queue, [0, 1, 2, 3, 4])
    assert queue.popleft() is blocks[0]
    assert blocks[0].prev_free is None and blocks[0].next_free is None
    queue.remove(blocks[2])  # middle
    queue.remove(blocks[4])  # tail
    queue.remove(blocks[1])  # head
    _check_links(queue, [3])
    queue.append(blocks[0])
    queue.append(blocks[4])
    _check_links(queue, [3, 0, 4])
    assert [b.block_id for b in queue.popleft_n(2)] == [3, 0]
    _check_links(queue, [4])
    assert queue.popleft_n(0) == []
    assert queue.popleft() is blocks[4]
    _check_links(queue, [])


def test_queue_errors_change_nothing() -> None:
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeBlockQueue(blocks[:2])
    with pytest.raises(ValueError, match="already queued"):
        queue.append(blocks[0])
    with pytest.raises(ValueError, match="not queued"):
        queue.remove(blocks[2])
    with pytest.raises(ValueError, match="n=3"):
        queue.popleft_n(3)
    with pytest.raises(ValueError, match="n=-1"):
        queue.popleft_n(-1)
    _check_links(queue, [0, 1])
    queue.popleft_n(2)
    with pytest.raises(ValueError, match="empty"):
        queue.popleft()
    _check_links(queue, [])


def test_queue_matches_list_model_under_random_ops() -> None:
    rng = random.Random(0)
    blocks = [KVCacheBlock(i) for i in range(40)]
    queue = FreeBlockQueue(blocks)
    model = list(range(40))  # oracle: plain list in queue order
    for _ in range(3000):
        op = rng.random()
        outside = sorted(set(range(40)) - set(model))
        if op < 0.3 and model:
            assert queue.popleft().block_id == model.pop(0)
        elif op < 0.45 and model:
            n = rng.randint(0, len(model))
            assert [b.block_id for b in queue.popleft_n(n)] == model[:n]
            del model[:n]
        elif op < 0.7 and model:
            victim = rng.choice(model)
            queue.remove(blocks[victim])
            model.remove(victim)
        elif outside:
            new = rng.choice(outside)
            queue.append(blocks[new])
            model.append(new)
        assert queue.num_free == len(model)
    _check_links(queue, model)
