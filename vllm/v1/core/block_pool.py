"""The pool of KV cache blocks: allocation, freeing, and the prefix-cache hash map."""

from __future__ import annotations

from collections.abc import Iterable

from vllm.v1.core.kv_cache_utils import FreeBlockQueue, KVCacheBlock


class BlockPool:
    """Owns every KV cache block, the free queue and the hash -> cached block map.

    Free blocks may still be cached (they keep their hash until reused), so a prefix hit can
    revive them. New blocks come from the queue head, so the least recently freed go first.
    All `num_blocks` blocks are usable; no block id is reserved.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        """Create `num_blocks` free blocks with ids 0..num_blocks-1.

        Raises ValueError if num_blocks is not a positive int.
        """
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Number of blocks nobody owns (free, possibly still cached)."""
        return self.free_queue.num_free

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the free queue head, each with ref_cnt 1 and no hash.

        A reused cached block loses its cache entry. Raises ValueError if fewer than n blocks
        are free (nothing changes then).
        """
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {n} blocks: only "
                             f"{self.free_queue.num_free} free")
        blocks = self.free_queue.popleft_n(n)
        cached = self.cached
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                if cached.get(block_hash) is block:
                    del cached[block_hash]
                block.block_hash = None
            block.ref_cnt = 1
        return blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those reaching 0 join the queue tail in order.

        Pass blocks in eviction order (first evicted first). Raises ValueError on a block that
        has no reference to drop (blocks before it are already released).
        """
        queue = self.free_queue
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"free_blocks: block {block.block_id} is already free")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue.append(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block, taking free ones out of the free queue."""
        queue = self.free_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> bool:
        """Register an owned, full block under `block_hash`.

        Returns False (and leaves the block uncached) when caching is off, the block already
        has a hash, or another block holds this hash already.
        """
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Returns False (and changes nothing) if any block is owned."""
        if self.free_queue.num_free != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True
