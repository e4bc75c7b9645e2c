"""The encoder cache: one encoder run per image while it is cached, pinned entries kept
over the budget, unpinned ones evicted least recently used first; and the keyed token view
prefix-cache hashes read."""

from __future__ import annotations

import torch

from vllm.multimodal.inputs import ImageFeature
from vllm.v1.core.kv_cache_utils import hash_block_tokens
from vllm.v1.core.mm_block_keys import KeyedTokens, image_key
from vllm.v1.worker.mm_step import EncoderCache


def _feature(key: str, length: int, offset: int = 0) -> ImageFeature:
    return ImageFeature(offset=offset, length=length, grid_thw=(1, 2, 2 * length),
                        pixel_bytes=b"", patch_dim=1, content_hash=key * 32)


def _encode(feature: ImageFeature) -> torch.Tensor:
    return torch.full((feature.length, 2), float(ord(feature.content_hash[0])))


def test_encoder_cache_runs_once_and_evicts_only_unpinned() -> None:
    cache = EncoderCache(budget=6)
    a, b, c = _feature("a", 4), _feature("b", 4), _feature("c", 4)
    first = cache.get(a, "r1", _encode)
    assert cache.get(a, "r2", _encode) is first  # cached: no second run
    cache.get(b, "r1", _encode)
    assert cache.encoder_runs == 2 and cache.rows == 8  # pinned: kept over the budget
    cache.unpin(a.content_hash, "r1")
    assert a.content_hash in cache.entries  # r2 still needs it
    cache.unpin(a.content_hash, "r2")
    assert a.content_hash not in cache.entries and cache.rows == 4
    cache.unpin(b.content_hash, "r1")
    assert b.content_hash in cache.entries  # within the budget: kept for reuse
    cache.get(c, "r3", _encode)
    assert b.content_hash not in cache.entries  # least recently used, unpinned
    assert cache.get(a, "r4", _encode).equal(first) and cache.encoder_runs == 4


def test_keyed_tokens_read_images_as_their_keys() -> None:
    tokens = [1, 2, 9, 9, 9, 3]
    image = _feature("d", 3, offset=2)
    keyed = KeyedTokens(tokens, [image])
    key = image_key(image)
    assert key < 0
    assert keyed[0:6] == [1, 2, key, key, key, 3] and keyed[4] == key and keyed[-1] == 3
    tokens.append(4)  # outputs: the view follows the list
    assert len(keyed) == 7 and keyed[5:7] == [3, 4]
    other = KeyedTokens(list(tokens), [_feature("e", 3, offset=2)])
    assert hash_block_tokens(None, keyed[0:4]) != hash_block_tokens(None, other[0:4])
    assert hash_block_tokens(None, keyed[0:2]) == hash_block_tokens(None, other[0:2])
