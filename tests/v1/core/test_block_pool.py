"""Tests for vllm/v1/core/block_pool.py: allocation, freeing, touching and the hash map."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm.v1.core.block_pool import BlockPool


def _check(pool: BlockPool) -> None:
    """Free queue = blocks with ref_cnt 0; hash map and block hashes agree."""
    queued = pool.free_queue.blocks()
    assert {b.block_id for b in queued} == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    assert len(queued) == pool.num_free_blocks
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached)


@pytest.fixture
def pool() -> Iterator[BlockPool]:
    """A 6-block pool that must be fully free again at the end of the test."""
    p = BlockPool(6)
    yield p
    _check(p)
    assert p.num_free_blocks == p.num_blocks == 6


def test_bad_size() -> None:
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="num_blocks"):
            BlockPool(bad)  # type: ignore[arg-type]


def test_allocate_from_head_and_free_to_tail(pool: BlockPool) -> None:
    first = pool.get_new_blocks(3)
    assert [b.block_id for b in first] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in first)
    assert pool.num_free_blocks == 3
    _check(pool)
    pool.free_blocks([first[2], first[0]])  # caller's eviction order
    assert [b.block_id for b in pool.free_queue.blocks()] == [3, 4, 5, 2, 0]
    with pytest.raises(ValueError, match="cannot allocate 6"):
        pool.get_new_blocks(6)
    assert pool.num_free_blocks == 5  # failed allocation changed nothing
    with pytest.raises(ValueError, match="already free"):
        pool.free_blocks([first[0]])
    pool.free_blocks([first[1]])
    _check(pool)


def test_shared_block_freed_only_by_last_owner(pool: BlockPool) -> None:
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 5
    pool.free_blocks([block])
    assert pool.num_free_blocks == 6


def test_cached_block_survives_free_and_is_revived_by_touch(pool: BlockPool) -> None:
    blocks = pool.get_new_blocks(2)
    assert pool.cache_block(blocks[0], 111)
    assert not pool.cache_block(blocks[0], 222)  # already has a hash
    assert not pool.cache_block(blocks[1], 111)  # hash taken by another block
    assert blocks[1].block_hash is None
    pool.free_blocks(blocks[::-1])
    assert pool.cached.get(111) is blocks[0]  # free but still cached
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 5
    assert blocks[0] not in pool.free_queue.blocks()
    _check(pool)
    pool.free_blocks([blocks[0]])


def test_reuse_evicts_hash_in_lru_order(pool: BlockPool) -> None:
    blocks = pool.get_new_blocks(6)
    for i, block in enumerate(blocks):
        pool.cache_block(block, 1000 + i)
    pool.free_blocks([blocks[4], blocks[1], blocks[5], blocks[0], blocks[2], blocks[3]])
    reused = pool.get_new_blocks(2)
    assert [b.block_id for b in reused] == [4, 1]
    assert all(b.block_hash is None for b in reused)
    assert pool.cached.get(1004) is None and pool.cached.get(1001) is None
    assert pool.cached.get(1005) is blocks[5]
    _check(pool)
    pool.free_blocks(reused)


def test_reset_prefix_cache(pool: BlockPool) -> None:
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], 7)
    assert not pool.reset_prefix_cache()
    assert pool.cached.get(7) is blocks[0]  # refused reset changed nothing
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.cached.get(7) is None and blocks[0].block_hash is None
    assert pool.cached == {}


def test_caching_disabled() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    assert not pool.cache_block(blocks[0], 5)
    assert pool.cached.get(5) is None and blocks[0].block_hash is None
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 2
