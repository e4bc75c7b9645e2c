"""Tests vllm/attention/backends/torch_backend.py against naive dense attention."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from tests.utils_attention import ReqStep, allocate_blocks, make_metadata
from tests.benchmarks.scripts import load_script
from vllm import _custom_ops
from vllm.attention.backends import torch_backend
from vllm.attention.backends.torch_backend import TorchAttentionBackend
from vllm.attention.kv_cache_dtype import FP8_DTYPE, FP8_MAX, quantize_fp8
from vllm.attention.selector import get_attn_backend_cls


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int, scale: float
) -> torch.Tensor:
    """q [n, H, D] for positions num_cached.., k/v [num_cached + n, Hkv, D] -> [n, H, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for j in range(q.shape[0]):
        visible = num_cached + j + 1
        scores = torch.einsum("hd,lhd->hl", q[j].double(), k[:visible]) * scale
        out[j] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v[:visible])
    return out


@pytest.fixture(params=["native", "tiled"])
def decode_path(request, monkeypatch) -> str:
    """Runs a test over both decode paths of a float32 CPU cache: the native kernel that reads
    the paged cache in place, and the torch tiled decode used without the native library."""
    if request.param == "native":
        if not _custom_ops.HAS_NATIVE:
            pytest.skip("native library not built (tests/test_custom_ops.py fails if it should be)")
    else:
        monkeypatch.setattr(TorchAttentionBackend, "_native_decode", lambda *args: False)
    return request.param


# (num_cached, num_new) per request: prefills, chunked prefills, decodes, an idle request.
CASES = {
    "mixed": [(0, 7), (5, 1), (9, 4), (0, 1), (17, 1), (3, 1), (6, 0), (2, 9)],
    "decode_only": [(4, 1), (0, 1), (30, 1), (11, 1)],
    "prefill_only": [(0, 5), (8, 3), (0, 16)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_naive_attention(
    case: str, num_heads: int, num_kv_heads: int, block_size: int, decode_path: str
) -> None:
    # crc32, not hash(): str hashes change with every interpreter (PYTHONHASHSEED).
    rng = random.Random(zlib.crc32(f"{case}/{num_heads}/{block_size}".encode()) % 1000)
    torch.manual_seed(rng.randrange(1000))
    head_size, pad = 8, 3
    reqs = CASES[case]
    totals = [c + n for c, n in reqs]
    block_ids, num_blocks = allocate_blocks(totals, block_size, rng)
    kv_cache = torch.randn(
        TorchAttentionBackend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    )
    # Full K/V history of every request; the cached prefix is placed in the cache up front.
    hist_k = [torch.randn(t, num_kv_heads, head_size) for t in totals]
    hist_v = [torch.randn(t, num_kv_heads, head_size) for t in totals]
    for (cached, _), ids, k, v in zip(reqs, block_ids, hist_k, hist_v):
        for p in range(cached):
            kv_cache[0, ids[p // block_size], p % block_size] = k[p]
            kv_cache[1, ids[p // block_size], p % block_size] = v[p]
    steps = [ReqStep(c, n, ids) for (c, n), ids in zip(reqs, block_ids)]
    meta, _ = make_metadata(steps, block_size, pad=pad)
    n_tok = meta.num_actual_tokens
    # Padding rows carry random K/V that must never reach the cache.
    junk = [torch.randn(pad, num_kv_heads, head_size)]
    key = torch.cat([k[c:] for (c, _), k in zip(reqs, hist_k)] + junk)
    value = torch.cat([v[c:] for (c, _), v in zip(reqs, hist_v)] + junk)
    query = torch.randn(n_tok + pad, num_heads, head_size)

    expected_cache = kv_cache.clone()
    for slot, k, v in zip(meta.slot_mapping[:n_tok].tolist(), key, value):
        expected_cache[0].view(-1, num_kv_heads, head_size)[slot] = k
        expected_cache[1].view(-1, num_kv_heads, head_size)[slot] = v

    scale = head_size**-0.5
    backend = TorchAttentionBackend(num_heads, head_size, num_kv_heads, scale)
    out = backend.forward(query, key, value, kv_cache, meta)

    assert out.shape == query.shape
    torch.testing.assert_close(kv_cache, expected_cache, rtol=0, atol=0)
    start = 0
    for (cached, new), k, v in zip(reqs, hist_k, hist_v):
        want = naive_attention(query[start : start + new], k, v, cached, scale)
        torch.testing.assert_close(out[start : start + new].double(), want, rtol=1e-5, atol=1e-5)
        start += new


@pytest.mark.parametrize("tile_bytes", [None, 2048])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (8, 8), (6, 1)])
def test_a_decode_is_bit_identical_alone_and_in_any_batch(
    num_heads: int, num_kv_heads: int, tile_bytes: int | None, decode_path: str, monkeypatch
) -> None:
    """The backend's promise: a request's result never depends on its batch (decode path),
    with the default tiles and with tiles of a few requests and blocks (then the probe's
    tile partners and the number of tiles change with the batch)."""
    if tile_bytes is not None:
        monkeypatch.setattr(torch_backend, "_TILE_BYTES", tile_bytes)
    rng = random.Random(num_heads * 10 + num_kv_heads)
    torch.manual_seed(0)
    head_size, block_size = 16, 16
    # Context lengths inside one 64-token bucket and in others, the probe first.
    lens = [100, 70, 128, 101, 3, 250, 65, 127] + [rng.randrange(65, 129) for _ in range(56)]
    block_ids, num_blocks = allocate_blocks(lens, block_size, rng)
    kv_cache = torch.randn(
        TorchAttentionBackend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    )
    queries = torch.randn(len(lens), num_heads, head_size)
    kvs = torch.randn(len(lens), num_kv_heads, head_size)
    backend = TorchAttentionBackend(num_heads, head_size, num_kv_heads, head_size**-0.5)

    def probe_output(members: list[int]) -> torch.Tensor:
        steps = [ReqStep(lens[i] - 1, 1, block_ids[i]) for i in members]
        meta, _ = make_metadata(steps, block_size, pad=0)
        idx = torch.tensor(members)
        out = backend.forward(queries[idx], kvs[idx], kvs[idx], kv_cache.clone(), meta)
        return out[members.index(0)]

    alone = probe_output([0])
    for members in ([0, 1, 2, 3], [4, 0, 5], list(range(64)), list(range(64))[::-1]):
        assert torch.equal(probe_output(members), alone), members


def test_padding_slots_are_not_written() -> None:
    backend = TorchAttentionBackend(2, 4, 2, 0.5)
    kv_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(2, 4, 2, 4))
    meta, _ = make_metadata([ReqStep(0, 3, [1])], block_size=4, pad=2)
    qkv = torch.ones(5, 2, 4)
    backend.forward(qkv, qkv, qkv, kv_cache, meta)
    written = kv_cache.flatten(3, 4).abs().sum(-1) > 0  # [2, num_blocks, block_size]
    expect = torch.zeros(2, 2, 4, dtype=torch.bool)
    expect[:, 1, :3] = True
    assert torch.equal(written, expect)


def test_selector() -> None:
    cpu = torch.device("cpu")
    assert get_attn_backend_cls("torch", cpu) is TorchAttentionBackend
    assert get_attn_backend_cls("auto", cpu) is TorchAttentionBackend
    with pytest.raises(ValueError, match="attention_backend"):
        get_attn_backend_cls("flash", cpu)


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.05, 4.0)])
def test_fp8_cache_stores_scaled_e4m3_and_attends_over_what_it_stored(
    k_scale: float, v_scale: float
) -> None:
    """With a float8_e4m3fn cache, writes hold key / k_scale (saturated at ±448) and the
    output is exact attention over the dequantized keys and values."""
    rng = random.Random(11)
    torch.manual_seed(11)
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 8, 4
    reqs = CASES["mixed"]
    totals = [c + n for c, n in reqs]
    block_ids, num_blocks = allocate_blocks(totals, block_size, rng)
    shape = TorchAttentionBackend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    kv_cache = torch.zeros(shape, dtype=FP8_DTYPE)
    hist_k = [3 * torch.randn(t, num_kv_heads, head_size) for t in totals]
    hist_v = [torch.randn(t, num_kv_heads, head_size) for t in totals]
    hist_k[0][2, 0, 0] = 1e4  # an outlier far past the e4m3 range: saturates, no NaN
    for (cached, _), ids, k, v in zip(reqs, block_ids, hist_k, hist_v):
        for p in range(cached):
            kv_cache[0, ids[p // block_size], p % block_size] = quantize_fp8(k[p], k_scale)
            kv_cache[1, ids[p // block_size], p % block_size] = quantize_fp8(v[p], v_scale)
    meta, _ = make_metadata([ReqStep(c, n, ids) for (c, n), ids in zip(reqs, block_ids)],
                            block_size)
    key = torch.cat([k[c:] for (c, _), k in zip(reqs, hist_k)])
    value = torch.cat([v[c:] for (c, _), v in zip(reqs, hist_v)])
    query = torch.randn(meta.num_actual_tokens, num_heads, head_size)
    backend = TorchAttentionBackend(num_heads, head_size, num_kv_heads, head_size**-0.5)
    backend.set_kv_scales(k_scale, v_scale)

    out = backend.forward(query, key, value, kv_cache, meta)

    assert kv_cache.dtype == FP8_DTYPE and not kv_cache.float().isnan().any()
    slot0 = block_ids[0][0] * block_size + 2
    assert kv_cache[0].view(-1, num_kv_heads, head_size)[slot0, 0, 0].item() == FP8_MAX
    start = 0
    for (cached, new), k, v in zip(reqs, hist_k, hist_v):
        k8 = quantize_fp8(k, k_scale).double() * k_scale
        v8 = quantize_fp8(v, v_scale).double() * v_scale
        want = naive_attention(query[start : start + new], k8, v8, cached, backend.scale)
        torch.testing.assert_close(out[start : start + new].double(), want, rtol=1e-5,
                                   atol=1e-5)
        # And close to attention over the unquantized values (e4m3 keeps 3 mantissa bits).
        if start > 0 and new:  # request 0 holds the saturated outlier
            exact = naive_attention(query[start : start + new], k, v, cached, backend.scale)
            assert (out[start : start + new].double() - exact).abs().max() < 0.25
        start += new


def test_kv_scales_must_be_finite_and_positive() -> None:
    backend = TorchAttentionBackend(2, 4, 2, 0.5)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="k_scale"):
            backend.set_kv_scales(k_scale=bad)
    backend.set_kv_scales(v_scale=0.5)
    assert (backend.k_scale, backend.v_scale) == (1.0, 0.5)


def _decode_step(
    lens: list[int], num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
    cache_dtype: torch.dtype, seed: int,
) -> tuple:
    """(query, key, value, cache, metadata) of one decode step over contexts `lens`, the
    cache filled with random values on shuffled blocks (float8: quantized at scale 1)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    block_ids, num_blocks = allocate_blocks(lens, block_size, rng)
    shape = TorchAttentionBackend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    kv_cache = torch.randn(shape).to(cache_dtype)
    meta, _ = make_metadata([ReqStep(n - 1, 1, ids) for n, ids in zip(lens, block_ids)],
                            block_size)
    query = torch.randn(len(lens), num_heads, head_size)
    key, value = torch.randn(2, len(lens), num_kv_heads, head_size)
    return query, key, value, kv_cache, meta


# Contexts: one token, a block's end and the next block's start, 64-token bucket edges,
# partial last blocks, and a few chunks' worth.
DECODE_LENS = [1, 4, 5, 16, 17, 63, 64, 65, 100, 127, 128, 129, 3, 250, 31, 2]


def _native_or_tiled_equals_gather(
    num_heads: int, num_kv_heads: int, block_size: int, cache_dtype: torch.dtype,
    scales: tuple[float, float] | None, head_size: int = 8, lens: list[int] = DECODE_LENS,
) -> None:
    """Asserts the backend's decode (whichever path is set up) equals gathering every whole
    context first (the backend before tiling, kept as the benchmark's baseline), float32 to
    rounding."""
    gather_cls = load_script("bench_attention").GatherAttentionBackend
    query, key, value, kv_cache, meta = _decode_step(
        lens, num_heads, num_kv_heads, head_size, block_size, cache_dtype,
        seed=block_size * 10 + num_heads + num_kv_heads)
    outs = []
    for cls in (TorchAttentionBackend, gather_cls):
        backend = cls(num_heads, head_size, num_kv_heads, head_size**-0.5)
        if scales is not None:
            backend.set_kv_scales(*scales)
        outs.append(backend.forward(query, key, value, kv_cache.clone(), meta))
    assert not outs[0].isnan().any()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tile_bytes", [None, 4096, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("fp8", [False, True])
def test_tiled_decode_equals_the_whole_context_gather(
    tile_bytes: int | None, num_heads: int, num_kv_heads: int, block_size: int, fp8: bool,
    monkeypatch,
) -> None:
    """The tiled decode (the path without the native library, and for float8 caches) with
    ragged contexts, tiles of two requests and chunks of one block, and float8 caches with
    scales."""
    monkeypatch.setattr(TorchAttentionBackend, "_native_decode", lambda *args: False)
    if tile_bytes is not None:
        monkeypatch.setattr(torch_backend, "_TILE_BYTES", tile_bytes)
    _native_or_tiled_equals_gather(num_heads, num_kv_heads, block_size,
                                   FP8_DTYPE if fp8 else torch.float32,
                                   (0.5, 3.0) if fp8 else None)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(4, 2, 8), (4, 4, 64),
                                                              (6, 1, 12), (32, 4, 16)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_native_decode_equals_the_whole_context_gather(
    num_heads: int, num_kv_heads: int, head_size: int, block_size: int
) -> None:
    """The native kernel with ragged contexts (a long one too), head sizes with and without a
    tail past the eight-lane products, and groups of 1 to 8 query heads per KV head."""
    if not _custom_ops.HAS_NATIVE:
        pytest.skip("native library not built (tests/test_custom_ops.py fails if it should be)")
    _native_or_tiled_equals_gather(num_heads, num_kv_heads, block_size, torch.float32, None,
                                   head_size, DECODE_LENS + [1500])


def test_decode_tiles_span_whole_blocks_and_hold_two_requests_at_least() -> None:
    """Chunks depend on the shapes only (so never on the batch), cover whole blocks, and a
    tile's keys stay near the byte budget; a long context still gets two rows per tile."""
    budget = torch_backend._TILE_BYTES
    for num_blocks, block_size, token_bytes in [(512, 16, 512), (4, 16, 512), (2048, 16, 4096),
                                               (8, 1, 64), (3, 128, 65536)]:
        chunk_blocks, rows = torch_backend._tiling(num_blocks, block_size, token_bytes)
        assert 1 <= chunk_blocks <= num_blocks and rows >= 2
        tile = rows * chunk_blocks * block_size * token_bytes
        assert tile <= budget or chunk_blocks == 1
