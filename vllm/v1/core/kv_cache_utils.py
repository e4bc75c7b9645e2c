"""Building blocks of the paged KV cache bookkeeping: blocks, the free queue, block hashes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Stands in for the parent hash of a request's first block. hash(None) is derived from an
# address in Python 3.11, so it would differ between processes; a fixed int does not.
ROOT_PARENT_HASH = 0x5EED_B10C_CAC4E


def block_hash_salt(lora_salt: int | None, cache_salt: str | None) -> int | None:
    """The parent hash of a request's first block (None: the common root): its adapter's salt
    (LoRARequest.cache_salt), mixed with the request's own `cache_salt` string when it has
    one, so requests share blocks only when both agree."""
    if cache_salt is None:
        return lora_salt
    # A digest, not hash(): str hashes are salted per process (as LoRARequest.cache_salt).
    key = f"cache_salt\0{lora_salt}\0{cache_salt}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Return the chained hash of a full block: its tokens plus the hash of the block before it.

    `parent_hash` is None for a request's first block. The result is the same in every process
    (Python hashes tuples of ints without the per-process string salt).
    """
    parent = ROOT_PARENT_HASH if parent_hash is None else parent_hash
    return hash((parent, tuple(token_ids)))


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """One physical KV cache block: its id, owner count, cache hash and free-queue links.

    Compared by identity, so blocks can be set members and the links never get traversed by ==.
    """

    # Index of the block in the device KV cache tensors.
    block_id: int
    # Number of requests that currently own the block; 0 means it sits in the free queue.
    ref_cnt: int = 0
    # Chained hash of the block's tokens while it is registered in the prefix cache.
    block_hash: int | None = None
    # Neighbours in the free queue; both None while the block is not queued.
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return (f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"block_hash={self.block_hash})")


class FreeBlockQueue:
    """Doubly linked queue of free blocks, least recently freed first.

    popleft, append and remove (from anywhere) are O(1): the links live in the blocks.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        """Create a queue holding `blocks` in order (they must not be queued elsewhere)."""
        # Sentinels remove the empty/ends special cases from every operation.
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def popleft(self) -> KVCacheBlock:
        """Remove and return the first block. Raises ValueError if the queue is empty."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("free block queue: popleft from an empty queue")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first `n` blocks in order.

        Raises ValueError if n is negative or exceeds the number of free blocks (nothing changes).
        """
        if n < 0 or n > self.num_free:
            raise ValueError(f"free block queue: cannot pop n={n} of {self.num_free} blocks")
        out: list[KVCacheBlock] = []
        head = self._head
        block = head.next_free
        for _ in range(n):
            assert block is not None
            nxt = block.next_free
            block.prev_free = None
            block.next_free = None
            out.append(block)
            block = nxt
        assert block is not None
        head.next_free = block
        block.prev_free = head
        self.num_free -= n
        return out

    def append(self, block: KVCacheBlock) -> None:
        """Add `block` at the tail. Raises ValueError if it is already queued."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"free block queue: block {block.block_id} is already queued")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Take `block` out of the queue wherever it is. Raises ValueError if it is not queued."""
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"free block queue: block {block.block_id} is not queued")
        self._unlink(block)

    def blocks(self) -> list[KVCacheBlock]:
        """Return the queued blocks from head to tail (O(n); for checks and tests)."""
        out: list[KVCacheBlock] = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free
        return out

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = None
        block.next_free = None
        self.num_free -= 1
