"""Tests for vllm/v1/core/kv_cache_manager.py: allocation, prefix caching, eviction."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

import vllm.v1.core.kv_cache_manager as kvm
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import hash_block_tokens

BS = 4  # block size used throughout


def _check_invariants(mgr: KVCacheManager, owners: dict[str, list[int]]) -> None:
    """ref counts = number of owners, free queue = unowned blocks, map and hashes agree."""
    pool = mgr.pool
    counts: Counter[int] = Counter()
    for req_id, ids in owners.items():
        assert mgr.get_block_ids(req_id) == ids
        assert len(set(ids)) == len(ids), f"{req_id} owns a block twice"
        counts.update(ids)
    for block in pool.blocks:
        assert block.ref_cnt == counts[block.block_id]
    queued = pool.free_queue.blocks()
    assert len(queued) == len({b.block_id for b in queued}) == mgr.num_free_blocks
    assert {b.block_id for b in queued} == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached)


@pytest.fixture
def make() -> Iterator[Callable[..., KVCacheManager]]:
    """Build managers; at teardown every one must be back to all blocks free and no owners."""
    made: list[KVCacheManager] = []

    def _make(num_blocks: int = 8, enable_caching: bool = True) -> KVCacheManager:
        mgr = KVCacheManager(num_blocks, BS, enable_caching)
        made.append(mgr)
        return mgr

    yield _make
    for mgr in made:
        assert mgr.num_free_blocks == mgr.num_blocks
        assert mgr.usage == 0.0
        _check_invariants(mgr, {})


def _admit(mgr: KVCacheManager, req_id: str, tokens: list[int]) -> tuple[list[int], int]:
    """Schedule the whole prompt the way the scheduler does; returns (block ids, num hit)."""
    hit_ids, num_hit = mgr.get_computed_blocks(req_id, tokens)
    new = mgr.allocate_slots(req_id, num_hit, len(tokens) - num_hit, tokens, hit_ids)
    assert new is not None
    assert new[:len(hit_ids)] == hit_ids
    return mgr.get_block_ids(req_id), num_hit


def test_bad_arguments(make: Callable[..., KVCacheManager]) -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, 4)
    mgr = make()
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.allocate_slots("a", 0, -1, [])
    tokens = list(range(8))
    _admit(mgr, "a", tokens)
    with pytest.raises(ValueError, match="already owns"):
        mgr.allocate_slots("a", 8, 1, tokens, [0])
    mgr.free("a")
    hit_ids, num_hit = mgr.get_computed_blocks("b", tokens + [9])
    assert num_hit == 8
    with pytest.raises(ValueError, match="more than num_computed_tokens"):
        mgr.allocate_slots("b", 4, 5, tokens + [9], hit_ids)
    with pytest.raises(ValueError, match="repeated"):
        mgr.allocate_slots("b", 8, 1, tokens + [9], [hit_ids[0], hit_ids[0]])
    with pytest.raises(ValueError, match="no block 99"):
        mgr.allocate_slots("b", 4, 5, tokens + [9], [99])
    with pytest.raises(ValueError, match="not the cached block"):
        mgr.allocate_slots("b", 8, 1, tokens + [9], hit_ids[::-1])
    assert mgr.get_block_ids("b") == [] and mgr.num_free_blocks == 8
    mgr.free("b")


def test_allocate_grow_and_free(make: Callable[..., KVCacheManager]) -> None:
    mgr = make(num_blocks=8)
    tokens = list(range(100, 110))  # 10 tokens -> 3 blocks
    assert mgr.allocate_slots("a", 0, 10, tokens) == [0, 1, 2]
    assert mgr.num_free_blocks == 5 and mgr.usage == pytest.approx(3 / 8)
    # Decoding into the partly filled third block needs nothing new.
    tokens.append(110)
    assert mgr.allocate_slots("a", 10, 1, tokens) == []
    tokens.append(111)
    assert mgr.allocate_slots("a", 11, 1, tokens) == []
    tokens.append(112)
    assert mgr.allocate_slots("a", 12, 1, tokens) == [3]
    # Lookahead slots count as well: 13 + 1 + 7 = 21 tokens -> 6 blocks.
    assert mgr.allocate_slots("a", 13, 1, tokens + [0], num_lookahead_tokens=7) == [4, 5]
    assert mgr.get_block_ids("a") == [0, 1, 2, 3, 4, 5]
    _check_invariants(mgr, {"a": [0, 1, 2, 3, 4, 5]})
    mgr.free("a")
    mgr.free("a")  # second free is a no-op
    mgr.free("never-seen")
    assert mgr.get_block_ids("a") == []


def test_trim_frees_the_tail_but_never_cached_blocks(make: Callable[..., KVCacheManager]) -> None:
    mgr = make(num_blocks=8)
    tokens = list(range(200, 210))  # 10 known tokens; 3 draft slots past them -> 4 blocks
    assert mgr.allocate_slots("a", 0, 13, tokens) == [0, 1, 2, 3]
    # Two drafts rejected: 11 tokens computed need 3 blocks; the fourth goes back.
    assert mgr.trim("a", 11) == 3
    assert mgr.get_block_ids("a") == [0, 1, 2] and mgr.num_free_blocks == 5
    _check_invariants(mgr, {"a": [0, 1, 2]})
    # Full blocks of known tokens (the first two, registered) are kept whatever is asked.
    assert mgr.trim("a", 1) == 2
    assert mgr.get_block_ids("a") == [0, 1]
    assert mgr.trim("never-seen", 4) == 0
    mgr.free("a")


def test_prefix_hit_across_requests_with_partial_last_block(
        make: Callable[..., KVCacheManager]) -> None:
    mgr = make(num_blocks=10)
    prompt_a = list(range(10))  # blocks [0..3] [4..7] and 2 tokens
    ids_a, hit_a = _admit(mgr, "a", prompt_a)
    assert hit_a == 0
    # b shares block 0 fully, block 1 only in its first 3 tokens.
    prompt_b = prompt_a[:7] + [99, 98, 97, 96, 95]
    ids_b, hit_b = _admit(mgr, "b", prompt_b)
    assert hit_b == BS
    assert ids_b[0] == ids_a[0]
    assert set(ids_b[1:]).isdisjoint(ids_a)
    # c extends a's prompt: both full blocks of a hit.
    prompt_c = prompt_a[:8] + [50, 51, 52]
    ids_c, hit_c = _admit(mgr, "c", prompt_c)
    assert hit_c == 2 * BS and ids_c[:2] == ids_a[:2]
    _check_invariants(mgr, {"a": ids_a, "b": ids_b, "c": ids_c})
    assert mgr.pool.blocks[ids_a[0]].ref_cnt == 3
    stats = mgr.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (3, 10 + 12 + 11, 3 * BS)
    assert stats.hit_rate == pytest.approx(12 / 33)
    for req_id in ("a", "b", "c"):
        mgr.free(req_id)


def test_at_least_one_token_left_to_compute(make: Callable[..., KVCacheManager]) -> None:
    mgr = make()
    prompt = list(range(2 * BS))  # exactly two full blocks
    ids_a, _ = _admit(mgr, "a", prompt)
    mgr.free("a")
    hit_ids, num_hit = mgr.get_computed_blocks("b", prompt)
    assert (hit_ids, num_hit) == (ids_a[:1], BS)  # the last block is dropped
    assert mgr.get_computed_blocks("c", prompt[:BS]) == ([], 0)
    assert mgr.get_computed_blocks("d", prompt + [7]) == (ids_a, 2 * BS)
    assert mgr.get_computed_blocks("e", []) == ([], 0)
    # Lookups take no references.
    assert mgr.num_free_blocks == mgr.num_blocks
    for req_id in "bcde":
        mgr.free(req_id)


def test_shared_blocks_survive_one_owner_freeing(make: Callable[..., KVCacheManager]) -> None:
    mgr = make(num_blocks=6)
    prompt = list(range(3 * BS + 1))
    ids_a, _ = _admit(mgr, "a", prompt)
    ids_b, hit_b = _admit(mgr, "b", prompt)
    assert hit_b == 3 * BS and ids_b[:3] == ids_a[:3] and ids_b[3] != ids_a[3]
    assert [mgr.pool.blocks[i].ref_cnt for i in ids_a] == [2, 2, 2, 1]
    mgr.free("a")
    _check_invariants(mgr, {"b": ids_b})
    assert mgr.num_free_blocks == 6 - 4
    # a's shared blocks are still owned by b, so a new request can't evict them.
    assert mgr.allocate_slots("x", 0, 2 * BS, list(range(500, 508))) == [5, ids_a[3]]
    assert mgr.get_computed_blocks("c", prompt)[1] == 3 * BS
    for req_id in ("b", "x", "c"):
        mgr.free(req_id)


def test_lru_eviction_and_reuse_of_evicted_ids(make: Callable[..., KVCacheManager]) -> None:
    mgr = make(num_blocks=6)
    prompt_a = list(range(2 * BS + 1))
    prompt_b = list(range(100, 100 + 2 * BS + 1))
    ids_a, _ = _admit(mgr, "a", prompt_a)  # 3 blocks
    ids_b, _ = _admit(mgr, "b", prompt_b)  # 3 blocks
    hashes_a = [mgr.pool.blocks[i].block_hash for i in ids_a[:2]]
    mgr.free("a")  # a is least recently freed
    mgr.free("b")
    # a's blocks go first, its tail block first of all.
    assert mgr.allocate_slots("c", 0, 2 * BS, list(range(200, 208))) == [ids_a[2], ids_a[1]]
    assert mgr.pool.cached.get(hashes_a[1]) is None
    assert mgr.pool.cached.get(hashes_a[0]) is mgr.pool.blocks[ids_a[0]]
    assert mgr.get_computed_blocks("a2", prompt_a) == (ids_a[:1], BS)
    assert mgr.get_computed_blocks("b2", prompt_b) == (ids_b[:2], 2 * BS)
    # The reused id now caches c's content under c's hash.
    reused = mgr.pool.blocks[ids_a[2]]
    assert reused.block_hash == hash_block_tokens(None, range(200, 204))
    for req_id in ("a2", "b2", "c"):
        mgr.free(req_id)


def test_failed_allocation_changes_nothing(make: Callable[..., KVCacheManager]) -> None:
    mgr = make(num_blocks=5)
    prompt = list(range(2 * BS + 1))
    ids_a, _ = _admit(mgr, "a", prompt)
    mgr.free("a")  # 3 free cached blocks (2 hashed)
    ids_x, _ = _admit(mgr, "x", list(range(300, 302)))  # takes a free block
    hit_ids, num_hit = mgr.get_computed_blocks("b", prompt + [1, 2, 3, 4])
    assert num_hit == 2 * BS

    def snapshot() -> tuple:
        pool = mgr.pool
        return (mgr.num_free_blocks, [b.block_id for b in pool.free_queue.blocks()],
                dict(pool.cached), [(b.ref_cnt, b.block_hash) for b in pool.blocks],
                mgr.get_block_ids("b"), mgr.get_block_ids("x"))

    before = snapshot()
    # 4 free blocks: 2 new blocks + 2 revived hits fit, 3 new + 2 hits do not.
    assert mgr.allocate_slots("b", num_hit, 3 * BS + 1, prompt + [1, 2, 3, 4], hit_ids) is None
    assert snapshot() == before
    assert mgr.allocate_slots("x", 2, 5 * BS, list(range(300, 302))) is None
    assert snapshot() == before
    new = mgr.allocate_slots("b", num_hit, 5, prompt + [1, 2, 3, 4], hit_ids)
    assert new is not None and new[:2] == hit_ids and len(new) == 4
    _check_invariants(mgr, {"b": new, "x": ids_x})
    mgr.free("b")
    mgr.free("x")


def test_caching_disabled(make: Callable[..., KVCacheManager]) -> None:
    mgr = make(num_blocks=4, enable_caching=False)
    prompt = list(range(2 * BS + 1))
    _admit(mgr, "a", prompt)
    mgr.free("a")
    assert mgr.get_computed_blocks("b", prompt) == ([], 0)
    assert mgr.pool.cached == {}
    assert all(b.block_hash is None for b in mgr.pool.blocks)
    stats = mgr.prefix_cache_stats
    assert (stats.queries, stats.hits) == (0, 0)
    mgr.free("b")


def test_hashes_only_known_tokens_and_each_block_once(
        make: Callable[..., KVCacheManager], monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = kvm.hash_block_tokens

    def recording(parent: int | None, token_ids: list[int]) -> int:
        calls.append(tuple(token_ids))
        return real(parent, token_ids)

    monkeypatch.setattr(kvm, "hash_block_tokens", recording)
    mgr = make(num_blocks=8)
    known = list(range(1, 7))  # 6 tokens known, 1.5 blocks
    # Async scheduling: 9 tokens scheduled but only 6 are known so far.
    assert mgr.allocate_slots("a", 0, 9, known) == [0, 1, 2]
    assert calls == [(1, 2, 3, 4)]  # never past len(token_ids)
    assert len(mgr.pool.cached) == 1
    # Another request with the real continuation hits only the block a's known tokens fill.
    assert mgr.get_computed_blocks("b", list(range(1, 11))) == ([0], BS)
    mgr.free("b")
    del calls[:]
    known += [7, 8, 9]
    assert mgr.allocate_slots("a", 9, 1, known) == []
    assert calls == [(5, 6, 7, 8)]  # block 0 is not hashed again
    assert mgr.get_computed_blocks("c", list(range(1, 11))) == ([0, 1], 2 * BS)
    mgr.free("a")
    mgr.free("c")


def test_lookup_hashes_are_reused_by_allocation(
        make: Callable[..., KVCacheManager], monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = kvm.hash_block_tokens
    monkeypatch.setattr(kvm, "hash_block_tokens",
                        lambda p, t: calls.append(tuple(t)) or real(p, t))
    mgr = make(num_blocks=8)
    prompt = list(range(3 * BS + 2))
    hit_ids, num_hit = mgr.get_computed_blocks("a", prompt)
    assert (hit_ids, num_hit) == ([], 0)
    assert len(calls) == 1  # lookup stops at the first miss
    # Chunked prefill: two chunks, then the rest.
    assert mgr.allocate_slots("a", 0, 5, prompt) == [0, 1]
    assert mgr.allocate_slots("a", 5, 5, prompt) == [2]
    assert mgr.allocate_slots("a", 10, 4, prompt) == [3]
    assert sorted(calls) == sorted({tuple(prompt[i * BS:(i + 1) * BS]) for i in range(3)})
    mgr.free("a")


def test_reset_prefix_cache(make: Callable[..., KVCacheManager]) -> None:
    mgr = make()
    prompt = list(range(2 * BS + 1))
    _admit(mgr, "a", prompt)
    assert not mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks("b", prompt)[1] == 2 * BS
    mgr.free("a")
    mgr.free("b")
    assert mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks("c", prompt) == ([], 0)
    mgr.free("c")


def test_randomized_against_simulated_kv_contents(make: Callable[..., KVCacheManager]) -> None:
    """Random admit/chunk/decode/preempt/free; a simulated KV store checks every hit's content."""
    rng = random.Random(1234)
    num_blocks = 24
    mgr = make(num_blocks=num_blocks)
    kv: dict[int, list[int | None]] = {i: [None] * BS for i in range(num_blocks)}
    prefixes = [[rng.randrange(5) for _ in range(rng.randint(0, 14))] for _ in range(4)]
    tokens: dict[str, list[int]] = {}  # known tokens of each live request
    computed: dict[str, int] = {}  # its num_computed_tokens (may run past known tokens)
    owners: dict[str, list[int]] = {}
    expected_hits = 0
    next_id = 0

    def write_kv(req_id: str, start: int, end: int) -> None:
        ids = owners[req_id]
        for pos in range(start, min(end, len(tokens[req_id]))):
            kv[ids[pos // BS]][pos % BS] = tokens[req_id][pos]
        for pos in range(len(tokens[req_id]), end):  # placeholder slots: unknown content
            kv[ids[pos // BS]][pos % BS] = None

    for step in range(1500):
        op = rng.random()
        live = sorted(tokens)
        if op < 0.3 or not live:  # admit a new (or previously preempted) request
            req_id = f"r{next_id}"
            next_id += 1
            prompt = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randint(1, 12))]
            hit_ids, num_hit = mgr.get_computed_blocks(req_id, prompt)
            assert num_hit == len(hit_ids) * BS < len(prompt)
            for i, block_id in enumerate(hit_ids):  # oracle: the hit KV holds these tokens
                assert kv[block_id] == prompt[i * BS:(i + 1) * BS]
            chunk = rng.randint(1, len(prompt) - num_hit)
            new = mgr.allocate_slots(req_id, num_hit, chunk, prompt, hit_ids)
            if new is None:
                mgr.free(req_id)  # a waiting request that gives up
                continue
            expected_hits += num_hit
            tokens[req_id] = prompt
            owners[req_id] = list(new)
            computed[req_id] = num_hit + chunk
            write_kv(req_id, num_hit, num_hit + chunk)
        elif op < 0.75:  # continue prefill or decode, sometimes with async placeholders
            req_id = rng.choice(live)
            toks = tokens[req_id]
            if computed[req_id] >= len(toks):
                toks.append(rng.randrange(5))  # the token sampled by the last step
            lag = rng.randint(0, 1)  # one in-flight token not known yet
            todo = max(1, len(toks) - computed[req_id] - lag)
            num = rng.randint(1, todo)
            lookahead = rng.choice([0, 0, 2])
            before = mgr.get_block_ids(req_id)
            new = mgr.allocate_slots(req_id, computed[req_id], num, toks[:len(toks) - lag],
                                     num_lookahead_tokens=lookahead)
            if new is None:  # preempt: free it; it may come back as a new request
                assert mgr.get_block_ids(req_id) == before
                mgr.free(req_id)
                del tokens[req_id], computed[req_id], owners[req_id]
            else:
                owners[req_id] += new
                total = computed[req_id] + num + lookahead
                assert len(owners[req_id]) == max(len(before), -(-total // BS))
                write_kv(req_id, computed[req_id], computed[req_id] + num)
                computed[req_id] += num
        else:  # finish
            req_id = rng.choice(live)
            mgr.free(req_id)
            del tokens[req_id], computed[req_id], owners[req_id]
        if step % 10 == 0:
            _check_invariants(mgr, owners)
            # Every cached block holds exactly the tokens its hash names (chain checked
            # through a request that owns it where one exists).
            for req_id, ids in owners.items():
                parent = None
                for i, block_id in enumerate(ids):
                    block_hash = mgr.pool.blocks[block_id].block_hash
                    if block_hash is None or i * BS + BS > len(tokens[req_id]):
                        break
                    expect = hash_block_tokens(parent, tokens[req_id][i * BS:(i + 1) * BS])
                    assert block_hash == expect
                    parent = expect
    assert expected_hits > 0  # the workload did exercise prefix hits
    assert mgr.prefix_cache_stats.hits >= expected_hits
    for req_id in list(tokens):
        mgr.free(req_id)


def test_cache_salt_separates_hash_chains(make: Callable[..., KVCacheManager]) -> None:
    """Requests with different salts (LoRA adapters) never share blocks; the same salt does,
    and no salt (the base model) is a chain of its own."""
    mgr = make(num_blocks=12)
    prompt = list(range(9))  # two full blocks and one token

    def admit(req_id: str, salt: int | None) -> tuple[list[int], int]:
        hit_ids, num_hit = mgr.get_computed_blocks(req_id, prompt, salt)
        assert mgr.allocate_slots(req_id, num_hit, len(prompt) - num_hit, prompt, hit_ids)
        return mgr.get_block_ids(req_id), num_hit

    ids_a, hit = admit("a", 1)
    assert hit == 0
    ids_b, hit = admit("b", 2)
    assert hit == 0 and set(ids_b).isdisjoint(ids_a)
    ids_base, hit = admit("base", None)
    assert hit == 0 and set(ids_base).isdisjoint(ids_a + ids_b)
    ids_a2, hit = admit("a2", 1)
    assert hit == 2 * BS and ids_a2[:2] == ids_a[:2]
    for req_id in ("a", "b", "base", "a2"):
        mgr.free(req_id)
