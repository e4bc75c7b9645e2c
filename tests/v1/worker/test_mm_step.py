"""The encoder cache: one encoder run per image while it is cached, pinned entries kept
over the budget, unpinned ones evicted least recently used first; the keyed token view
prefix-cache hashes read; and a step's M-RoPE positions."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from vllm.multimodal.inputs import ImageFeature
from vllm.v1.core.kv_cache_utils import hash_block_tokens
from vllm.v1.core.mm_block_keys import KeyedTokens, image_key
from vllm.v1.worker.mm_step import EncoderCache, MultiModalInputs


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


def test_mrope_follows_the_device_positions_of_tokens_after_the_prompt() -> None:
    """A step's M-RoPE positions: prompt tokens from their request's table (image runs on
    a grid), later tokens at their staged device position plus the request's delta. The
    device position, not the host's: a request verified with drafts while its previous step
    was in flight is placed after the tokens it kept on the device only."""
    model = torch.nn.Linear(1, 1)
    model.config = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2))
    model.visual = None  # a stage without the tower: positions only
    mm = MultiModalInputs(model, budget=0, to_device=torch.from_numpy)
    # A 10-token prompt with a 2 x 2 image (a grid of 4 x 4 patches) at tokens 2..5: text
    # at 0 and 1, the image at (2, 2 + row, 2 + column), the text after it from 4, so
    # later tokens sit at their index - 2.
    image = ImageFeature(offset=2, length=4, grid_thw=(1, 4, 4), pixel_bytes=b"",
                         patch_dim=1, content_hash="i" * 32)
    prompt = list(range(10))
    states = {
        0: SimpleNamespace(mm_features=[image], mrope=None, prompt_token_ids=prompt,
                           req_id="decode"),
        1: SimpleNamespace(mm_features=[image], mrope=None, prompt_token_ids=prompt,
                           req_id="prefill"),
        2: SimpleNamespace(mm_features=None, mrope=None, prompt_token_ids=prompt,
                           req_id="text"),
    }
    # Host positions: the decode request assumed both drafts kept (12..14); on the device
    # it was placed after one (11..13). The prefill computes prompt tokens 1..6.
    host = np.array([12, 13, 14, 1, 2, 3, 4, 5, 6, 7, 8, 0])
    device = torch.tensor([11, 12, 13, 1, 2, 3, 4, 5, 6, 7, 8, 0])
    inputs = SimpleNamespace(rows=[0, 1, 2], cu=np.array([0, 3, 9, 11]),
                             starts=np.array([12, 1, 7]), positions=host, padded_tokens=12)
    got = mm.build(SimpleNamespace(states=states), inputs, device)["mm"].mrope_positions
    want = torch.tensor([
        [9, 10, 11, 1, 2, 2, 2, 2, 4, 7, 8, 0],
        [9, 10, 11, 1, 2, 2, 3, 3, 4, 7, 8, 0],
        [9, 10, 11, 1, 2, 3, 2, 3, 4, 7, 8, 0],
    ])
    assert got.equal(want)
