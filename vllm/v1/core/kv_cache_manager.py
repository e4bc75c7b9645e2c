"""KVCacheManager: which KV cache blocks each request owns, with prefix caching."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock, hash_block_tokens
from vllm.v1.metrics.engine_stats import KVCacheStats


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache lookups, counted in tokens."""

    # Number of get_computed_blocks lookups.
    requests: int = 0
    # Tokens looked up (the full token list of each lookup).
    queries: int = 0
    # Tokens found in the cache.
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens that hit (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class _RequestBlocks:
    """What the manager remembers about one request."""

    # Blocks the request owns, in token order.
    blocks: list[KVCacheBlock] = field(default_factory=list)
    # Memoized chained hashes of the request's first len(hashes) full blocks.
    hashes: list[int] = field(default_factory=list)
    # The first num_cached blocks went through cache registration already.
    num_cached: int = 0
    # Parent hash of the first block (None: the common root). Requests that must never
    # share blocks with each other (different LoRA adapters) get different salts.
    salt: int | None = None


class KVCacheManager:
    """Assigns paged KV cache blocks to requests and shares full blocks by prefix hash.

    The scheduler's only view of the KV cache. Requests are named by id; the manager keeps
    the blocks (and memoized block hashes) of each until `free(request_id)`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        """Create a manager over `num_blocks` blocks of `block_size` tokens.

        Raises ValueError if num_blocks or block_size is not a positive int.
        """
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.pool = BlockPool(num_blocks, enable_caching)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._reqs: dict[str, _RequestBlocks] = {}
        self._stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request owns (free, or cached but evictable)."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by requests, in [0, 1]."""
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """A snapshot of the cumulative prefix-cache lookup counters."""
        s = self._stats
        return PrefixCacheStats(requests=s.requests, queries=s.queries, hits=s.hits)

    def make_stats(self) -> KVCacheStats:
        """This cache's part of the engine's stats record: its gauges and prefix counters."""
        return KVCacheStats(usage=self.usage, num_free_blocks=self.num_free_blocks,
                            num_blocks=self.num_blocks, prefix_cache_queries=self._stats.queries,
                            prefix_cache_hits=self._stats.hits)

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int],
                            cache_salt: int | None = None) -> tuple[list[int], int]:
        """Find the longest cached prefix of full blocks of `token_ids`.

        Returns (block ids, number of tokens they hold). At least one token of `token_ids` is
        always left out so the request has something to compute. Takes no references; pass
        the ids to `allocate_slots` right away, before other allocations can evict them.
        Side effects: counts the lookup in the stats and memoizes the request's block hashes
        (released by `free(request_id)`). Returns ([], 0) when caching is off.
        `cache_salt` starts the request's hash chain (its blocks are shared only with
        requests of the same salt; None is the base model's); it must be the same every
        time the request is looked up.
        """
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        num_tokens = len(token_ids)
        max_blocks = max(0, (num_tokens - 1) // bs)
        state = self._reqs.get(request_id)
        if state is None:
            state = self._reqs[request_id] = _RequestBlocks(salt=cache_salt)
        hashes = state.hashes
        cached = self.pool.cached
        ids: list[int] = []
        parent = state.salt
        for i in range(max_blocks):
            if i < len(hashes):
                block_hash = hashes[i]
            else:
                block_hash = hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs])
                hashes.append(block_hash)
            block = cached.get(block_hash)
            if block is None:
                break
            ids.append(block.block_id)
            parent = block_hash
        num_hit = len(ids) * bs
        stats = self._stats
        stats.requests += 1
        stats.queries += num_tokens
        stats.hits += num_hit
        return ids, num_hit

    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                       token_ids: Sequence[int], new_computed_block_ids: Sequence[int] = (),
                       num_lookahead_tokens: int = 0,
                       cache_salt: int | None = None) -> list[int] | None:
        """Make the request own enough blocks for its computed, new and lookahead tokens.

        `new_computed_block_ids` are prefix hits from `get_computed_blocks` for a request that
        owns no blocks yet; they become its first blocks and `num_computed_tokens` includes
        them. Returns the ids appended to the request (hits first), [] if none were needed, or
        None when too few blocks are free, in which case nothing changes.
        Side effects: every owned block full of known tokens (within the first
        min(num_computed_tokens + num_new_tokens, len(token_ids))) is registered in the cache.
        `cache_salt` starts the hash chain of a request the manager does not know yet (one
        admitted without a lookup, e.g. with prompt logprobs), as in `get_computed_blocks`,
        so the blocks it registers are found only under its own salt.
        Raises ValueError on negative counts, or hit ids that are unknown, uncached, repeated,
        given to a request that already owns blocks, or not covered by the token counts.
        """
        if num_computed_tokens < 0 or num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                "allocate_slots: num_computed_tokens, num_new_tokens and num_lookahead_tokens "
                f"must be >= 0, got {num_computed_tokens}, {num_new_tokens}, "
                f"{num_lookahead_tokens}")
        bs = self.block_size
        state = self._reqs.get(request_id)
        num_owned = len(state.blocks) if state is not None else 0
        hits = self._check_hits(request_id, state, num_owned, num_computed_tokens,
                                token_ids, new_computed_block_ids) if new_computed_block_ids else []

        num_total = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_needed = -(-num_total // bs) - num_owned - len(hits)
        if num_needed < 0:
            num_needed = 0
        # Free hit blocks are counted as free, so touching them uses up free blocks too.
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed + num_revived > self.pool.num_free_blocks:
            return None

        if state is None:
            state = self._reqs[request_id] = _RequestBlocks(salt=cache_salt)
        if hits:
            # Touch before allocating so the new blocks cannot evict the hits.
            self.pool.touch(hits)
            state.blocks.extend(hits)
            state.num_cached = len(hits)
        new_blocks = self.pool.get_new_blocks(num_needed) if num_needed else []
        if new_blocks:
            state.blocks.extend(new_blocks)
        if self.enable_caching:
            num_known = min(num_computed_tokens + num_new_tokens, len(token_ids))
            self._cache_full_blocks(state, num_known // bs, token_ids)
        if not hits:
            return [b.block_id for b in new_blocks]
        return [b.block_id for b in hits] + [b.block_id for b in new_blocks]

    def free(self, request_id: str) -> None:
        """Release the request's blocks and memoized hashes; a no-op for an unknown request.

        Blocks are released last first, so a request's tail blocks are evicted before its
        (more shareable) head blocks.
        """
        state = self._reqs.pop(request_id, None)
        if state is not None and state.blocks:
            self.pool.free_blocks(reversed(state.blocks))

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Frees the request's blocks past the first ceil(num_tokens / block_size) (the slots
        of rejected drafts); returns how many blocks it keeps. Blocks registered in the
        prefix cache are never freed here (they hold confirmed tokens); an unknown request
        keeps 0."""
        state = self._reqs.get(request_id)
        if state is None:
            return 0
        keep = max(-(-num_tokens // self.block_size), state.num_cached)
        if keep < len(state.blocks):
            tail = state.blocks[keep:]
            del state.blocks[keep:]
            self.pool.free_blocks(reversed(tail))
        return len(state.blocks)

    def get_block_ids(self, request_id: str) -> list[int]:
        """Return the ids of the blocks the request owns, in token order ([] if none)."""
        state = self._reqs.get(request_id)
        if state is None:
            return []
        return [b.block_id for b in state.blocks]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash. Returns False (changing nothing) if blocks are in use."""
        return self.pool.reset_prefix_cache()

    def _check_hits(self, request_id: str, state: _RequestBlocks | None, num_owned: int,
                    num_computed_tokens: int, token_ids: Sequence[int],
                    block_ids: Sequence[int]) -> list[KVCacheBlock]:
        """Validate prefix-hit ids and return their blocks. Raises ValueError on bad input."""
        if num_owned:
            raise ValueError(f"new_computed_block_ids: request {request_id!r} already owns "
                             f"{num_owned} blocks")
        num_hit_tokens = len(block_ids) * self.block_size
        if num_hit_tokens > num_computed_tokens or num_hit_tokens > len(token_ids):
            raise ValueError(
                f"new_computed_block_ids: {len(block_ids)} blocks hold {num_hit_tokens} tokens, "
                f"more than num_computed_tokens={num_computed_tokens} or "
                f"len(token_ids)={len(token_ids)}")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"new_computed_block_ids: repeated ids in {list(block_ids)}")
        all_blocks = self.pool.blocks
        memo = state.hashes if state is not None else []
        hits: list[KVCacheBlock] = []
        for i, block_id in enumerate(block_ids):
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"new_computed_block_ids: no block {block_id}")
            block = all_blocks[block_id]
            if block.block_hash is None or (i < len(memo) and block.block_hash != memo[i]):
                raise ValueError(f"new_computed_block_ids: block {block_id} is not the cached "
                                 f"block {i} of request {request_id!r} (evicted since lookup?)")
            hits.append(block)
        return hits

    def _cache_full_blocks(self, state: _RequestBlocks, num_full: int,
                           token_ids: Sequence[int]) -> None:
        """Register the request's blocks [num_cached, num_full) in the prefix cache."""
        num_full = min(num_full, len(state.blocks))
        start = state.num_cached
        if num_full <= start:
            return
        bs = self.block_size
        hashes = state.hashes
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i else state.salt
            hashes.append(hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs]))
        blocks = state.blocks
        cache_block = self.pool.cache_block
        for i in range(start, num_full):
            cache_block(blocks[i], hashes[i])
        state.num_cached = num_full
