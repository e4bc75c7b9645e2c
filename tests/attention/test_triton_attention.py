"""Tests for the Triton paged attention kernels and TritonAttentionBackend.

Every result is compared with a dense float64 attention computed here from the keys and
values the test generated, so the paged cache layout is checked too. Without CUDA the
kernels run in Triton's interpreter, which must be switched on before triton is imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    # Must precede the first `import triton` in this process: triton.language's own helpers
    # are defined for the interpreter or the compiler at that moment.
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

import vllm.attention.backends.triton_backend as triton_backend  # noqa: E402
import vllm.attention.ops.triton_reshape_and_cache as cache_ops  # noqa: E402
import vllm.attention.ops.triton_unified_attention as attn_ops  # noqa: E402
from vllm.attention.backends.abstract import AttentionMetadata  # noqa: E402

if DEVICE.type == "cpu" and not isinstance(
    attn_ops._unified_attention_kernel, triton.runtime.interpreter.InterpretedFunction
):
    raise RuntimeError(
        "triton was imported before TRITON_INTERPRET=1 was set; without CUDA set it in "
        "tests/conftest.py (before any import of triton) or in the environment"
    )

TritonAttentionBackend = triton_backend.TritonAttentionBackend
MAX_REL_ERR = 1e-5


@dataclass
class Batch:
    """A random paged batch plus the dense per-request K/V it was built from."""

    query: torch.Tensor  # [T, H, D] (T may include padding rows)
    key: torch.Tensor  # [T, KVH, D] new keys
    value: torch.Tensor  # [T, KVH, D] new values
    kv_cache: torch.Tensor  # [2, blocks, block_size, KVH, D], cached part filled
    metadata: AttentionMetadata
    dense_k: list[torch.Tensor]  # per request [seq_len, KVH, D]
    dense_v: list[torch.Tensor]
    q_lens: list[int]
    seq_lens: list[int]


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    num_padding: int = 0,
    seed: int = 0,
) -> Batch:
    """Builds a batch whose cached tokens are already in the cache at shuffled block ids."""
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(q_lens)
    blocks_per_req = [triton.cdiv(s, block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req)
    num_blocks = sum(blocks_per_req) + 3
    block_ids = torch.randperm(num_blocks, generator=g)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=g)
    block_table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    dense_k, dense_v, slots, new_k, new_v = [], [], [], [], []
    used = 0
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        ids = block_ids[used : used + blocks_per_req[i]]
        used += blocks_per_req[i]
        block_table[i, : len(ids)] = ids.to(torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=g)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=g)
        dense_k.append(k)
        dense_v.append(v)
        pos = torch.arange(seq_len)
        req_slots = ids[pos // block_size] * block_size + pos % block_size
        ctx = seq_len - q_len
        # Cached tokens go straight into the cache; new ones are the kernel's job.
        flat = kv_cache.view(2, -1, num_kv_heads, head_size)
        flat[0, req_slots[:ctx]] = k[:ctx]
        flat[1, req_slots[:ctx]] = v[:ctx]
        slots.append(req_slots[ctx:])
        new_k.append(k[ctx:])
        new_v.append(v[ctx:])
    num_actual = sum(q_lens)
    pad_kv = torch.full((num_padding, num_kv_heads, head_size), 1e4)
    key = torch.cat(new_k + [pad_kv])
    value = torch.cat(new_v + [pad_kv])
    query = torch.randn(num_actual + num_padding, num_heads, head_size, generator=g)
    slot_mapping = torch.cat(slots + [torch.full((num_padding,), -1)]).to(torch.int64)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=num_actual,
        num_reqs=num_reqs,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=qsl.to(DEVICE),
        seq_lens=seq_lens_t.to(DEVICE),
        block_table=block_table.to(DEVICE),
        slot_mapping=slot_mapping.to(DEVICE),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens_t,
    )
    return Batch(
        query.to(DEVICE), key.to(DEVICE), value.to(DEVICE), kv_cache.to(DEVICE), metadata,
        dense_k, dense_v, q_lens, seq_lens,
    )


def reference(batch: Batch, scale: float) -> torch.Tensor:
    """Dense causal attention per request in float64: [num_actual_tokens, H, D]."""
    query = batch.query.double().cpu()
    num_heads = query.shape[1]
    outs = []
    start = 0
    for q_len, seq_len, k, v in zip(batch.q_lens, batch.seq_lens, batch.dense_k, batch.dense_v):
        q = query[start : start + q_len]
        start += q_len
        group = num_heads // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute error relative to the largest reference magnitude."""
    out = out.double().cpu()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def run_kernels(batch: Batch, scale: float, num_splits: int | None) -> torch.Tensor:
    """Writes the new K/V with the cache kernel, then runs unified attention."""
    md = batch.metadata
    n = md.num_actual_tokens
    cache_ops.reshape_and_cache(batch.key, batch.value, batch.kv_cache, md.slot_mapping, n)
    out = torch.full_like(batch.query, float("nan"))
    attn_ops.unified_attention(
        batch.query, batch.kv_cache[0], batch.kv_cache[1], out, md.query_start_loc,
        md.seq_lens, md.block_table, num_tokens=n, num_reqs=md.num_reqs,
        max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, scale=scale,
        num_splits=num_splits,
    )
    return out


def test_reshape_and_cache_writes_slots_and_skips_padding() -> None:
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size, kv_heads, head = 5, 16, 2, 64
    key = torch.randn(6, kv_heads, head, generator=g)
    value = torch.randn(6, kv_heads, head, generator=g)
    # Token 2 is padding (-1); token 5 lies past num_tokens and must not be written either.
    slots = torch.tensor([17, 3, -1, 79, 40, 0], dtype=torch.int64)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head, generator=g)
    expected = cache.clone()
    flat = expected.view(2, -1, kv_heads, head)
    for t in [0, 1, 3, 4]:
        flat[0, slots[t]] = key[t]
        flat[1, slots[t]] = value[t]
    dev_cache = cache.to(DEVICE)
    cache_ops.reshape_and_cache(
        key.to(DEVICE), value.to(DEVICE), dev_cache, slots.to(DEVICE), num_tokens=5
    )
    assert torch.equal(dev_cache.cpu(), expected)


def test_reshape_and_cache_rejects_mismatched_cache() -> None:
    key = torch.zeros(2, 2, 64, device=DEVICE)
    cache = torch.zeros(2, 3, 16, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="kv_cache"):
        cache_ops.reshape_and_cache(key, key, cache, torch.zeros(2, dtype=torch.int64))


# (q_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, num_splits)
CASES = {
    # A fresh prefill, a decode and a chunked prefill over cached context, in one batch.
    "mixed_b16_d64_gqa2": ([5, 1, 3], [5, 40, 70], 4, 2, 64, 16, 1),
    # Requests spanning two query blocks (block_q is 16 with 4 heads per KV head).
    "mixed_b32_d128_gqa4": ([20, 1], [90, 33], 4, 1, 128, 32, 1),
    "decode_b16_d32_mha": ([1, 1, 1], [1, 17, 64], 2, 2, 32, 16, 1),
    "prefill_b16_d80_gqa3": ([7], [7], 3, 1, 80, 16, 1),
    "split_decode_b16_d64": ([1, 1, 1], [3, 150, 300], 4, 2, 64, 16, 4),
    "split_mixed_b32_d128": ([6, 1], [40, 130], 2, 1, 128, 32, 2),
    # Left to the heuristic, which splits a long decode-only batch (checked below).
    "auto_split_decode_b16_d64": ([1], [600], 2, 1, 64, 16, None),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_unified_attention_matches_dense_reference(case: str) -> None:
    q_lens, seq_lens, heads, kv_heads, head, block, splits = CASES[case]
    batch = make_batch(q_lens, seq_lens, heads, kv_heads, head, block)
    scale = head**-0.5
    out = run_kernels(batch, scale, splits)
    assert rel_err(out, reference(batch, scale)) <= MAX_REL_ERR


@pytest.mark.parametrize(
    ("dtype", "splits"), [(torch.bfloat16, 1), (torch.float16, 2)], ids=["bf16", "fp16_split"]
)
def test_unified_attention_half_precision(dtype: torch.dtype, splits: int) -> None:
    batch = make_batch([4, 1], [4, 45], 4, 2, 64, 16, seed=6)
    batch.query, batch.key, batch.value = (t.to(dtype) for t in (batch.query, batch.key,
                                                                batch.value))
    batch.kv_cache = batch.kv_cache.to(dtype)
    # The oracle sees the same rounded inputs; what remains is 16-bit rounding inside.
    batch.dense_k = [k.to(dtype).float() for k in batch.dense_k]
    batch.dense_v = [v.to(dtype).float() for v in batch.dense_v]
    out = run_kernels(batch, 0.125, splits)
    assert out.dtype == dtype
    assert rel_err(out, reference(batch, 0.125)) <= 2e-2


def test_split_and_unsplit_paths_agree() -> None:
    batch = make_batch([1, 1], [100, 260], 2, 1, 64, 16, seed=3)
    plain = run_kernels(batch, 0.125, num_splits=1)
    split = run_kernels(batch, 0.125, num_splits=8)
    assert rel_err(split, plain.double().cpu()) <= MAX_REL_ERR
    assert rel_err(split, reference(batch, 0.125)) <= MAX_REL_ERR


def test_backend_handles_padding_rows_and_leaves_other_slots() -> None:
    batch = make_batch([4, 1, 2], [4, 50, 20], 4, 2, 64, 16, num_padding=3, seed=4)
    before = batch.kv_cache.clone().cpu()
    backend = TritonAttentionBackend(4, 64, 2, 0.125)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    n = batch.metadata.num_actual_tokens
    assert out.shape == batch.query.shape
    assert rel_err(out[:n], reference(batch, 0.125)) <= MAX_REL_ERR
    assert torch.equal(out[n:].cpu(), torch.zeros_like(out[n:].cpu()))
    # Only the real new tokens' slots changed; padding (slot -1) wrote nothing.
    changed = (batch.kv_cache.cpu() != before).view(2, -1, 2 * 64).any(-1).any(0)
    slots = batch.metadata.slot_mapping[:n].cpu()
    expected = torch.zeros_like(changed)
    expected[slots] = True
    assert torch.equal(changed, expected)


def test_unified_attention_rejects_bad_arguments() -> None:
    batch = make_batch([2], [2], 2, 1, 64, 16)
    md = batch.metadata

    def call(cache: torch.Tensor, splits: int | None) -> None:
        attn_ops.unified_attention(
            batch.query, cache[0], cache[1], torch.empty_like(batch.query),
            md.query_start_loc, md.seq_lens, md.block_table, num_tokens=2, num_reqs=1,
            max_query_len=2, max_seq_len=2, scale=0.125, num_splits=splits,
        )

    with pytest.raises(ValueError, match="num_splits"):
        call(batch.kv_cache, 3)
    with pytest.raises(ValueError, match="key_cache"):
        call(batch.kv_cache.half(), None)


def test_choose_num_splits_heuristic() -> None:
    assert attn_ops.choose_num_splits(1, 1, 1, 600, 132) == 2
    # Long decode with few programs: split, as a power of two, each segment >= 256 keys.
    assert attn_ops.choose_num_splits(1, 8, 1, 2048, 132) == 8
    assert attn_ops.choose_num_splits(2, 2, 1, 100_000, 132) == 64
    # Prefill present, short contexts, or enough programs already: no split.
    assert attn_ops.choose_num_splits(1, 8, 5, 4096, 132) == 1
    assert attn_ops.choose_num_splits(1, 8, 1, 300, 132) == 1
    assert attn_ops.choose_num_splits(64, 8, 1, 4096, 132) == 1


def test_backend_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        TritonAttentionBackend(6, 64, 4, 0.125)
    with pytest.raises(ValueError, match="num_splits"):
        TritonAttentionBackend(4, 64, 2, 0.125, num_splits=3)
    backend = TritonAttentionBackend(4, 64, 2, 0.125)
    batch = make_batch([2], [2], 4, 2, 64, 16)
    with pytest.raises(ValueError, match="query"):
        backend.forward(
            batch.query[:, :2], batch.key, batch.value, batch.kv_cache, batch.metadata
        )


def test_backend_matches_torch_backend() -> None:
    from vllm.attention.backends.torch_backend import TorchAttentionBackend

    batch = make_batch([3, 1, 1, 5], [3, 33, 70, 21], 4, 1, 128, 32, num_padding=2, seed=5)
    md = batch.metadata
    torch_cache = batch.kv_cache.clone()
    scale = 128**-0.5
    ours = TritonAttentionBackend(4, 128, 1, scale).forward(
        batch.query, batch.key, batch.value, batch.kv_cache, md
    )
    theirs = TorchAttentionBackend(4, 128, 1, scale).forward(
        batch.query, batch.key, batch.value, torch_cache, md
    )
    n = md.num_actual_tokens
    assert rel_err(ours[:n], theirs[:n].double().cpu()) <= MAX_REL_ERR
    assert torch.equal(batch.kv_cache, torch_cache)


def _to_fp8(batch: Batch, k_scale: float, v_scale: float) -> None:
    """Turns batch's cache into an FP8 one holding its cached tokens quantized (k_scale for
    keys, v_scale for values), and its dense K/V into what that cache dequantizes to."""
    from vllm.attention.kv_cache_dtype import quantize_fp8

    cache = batch.kv_cache.cpu()
    batch.kv_cache = torch.stack(
        [quantize_fp8(cache[0], k_scale), quantize_fp8(cache[1], v_scale)]
    ).to(DEVICE)
    batch.dense_k = [quantize_fp8(k, k_scale).double() * k_scale for k in batch.dense_k]
    batch.dense_v = [quantize_fp8(v, v_scale).double() * v_scale for v in batch.dense_v]


@pytest.mark.parametrize("splits", [1, 4], ids=["unsplit", "split4"])
def test_fp8_cache_matches_torch_backend_with_fp8_cache(splits: int) -> None:
    """Triton with a float8_e4m3fn cache and per-tensor scales: the bytes it writes and the
    attention it computes over them match the torch backend on the same FP8 cache."""
    from vllm.attention.backends.torch_backend import TorchAttentionBackend
    from vllm.attention.kv_cache_dtype import FP8_DTYPE, FP8_MAX

    k_scale, v_scale = 0.25, 2.0
    batch = make_batch([3, 1, 1, 5], [3, 33, 70, 21], 4, 2, 64, 16, num_padding=2, seed=8)
    batch.key[0, 0, 0] = 1e4  # saturates at 448 * k_scale rather than becoming NaN
    _to_fp8(batch, k_scale, v_scale)
    md = batch.metadata
    torch_cache = batch.kv_cache.clone()
    scale = 64**-0.5
    ours = TritonAttentionBackend(4, 64, 2, scale, num_splits=splits)
    theirs = TorchAttentionBackend(4, 64, 2, scale)
    for backend in (ours, theirs):
        backend.set_kv_scales(k_scale, v_scale)
    out = ours.forward(batch.query, batch.key, batch.value, batch.kv_cache, md)
    ref = theirs.forward(batch.query, batch.key, batch.value, torch_cache, md)

    assert batch.kv_cache.dtype == FP8_DTYPE
    written = batch.kv_cache.float().cpu()
    assert not written.isnan().any()
    assert written.view(2, -1, 2, 64)[0, md.slot_mapping[0].item(), 0, 0] == FP8_MAX
    if DEVICE.type == "cpu":
        assert torch.equal(written, torch_cache.float().cpu())
    else:  # the GPU may round a division differently by one e4m3 step
        torch.testing.assert_close(written, torch_cache.float().cpu(), rtol=0.07, atol=0.002)
    n = md.num_actual_tokens
    assert rel_err(out[:n], ref[:n].double().cpu()) <= MAX_REL_ERR
    assert torch.equal(out[n:].cpu(), torch.zeros_like(out[n:].cpu()))


def test_fp8_kernels_dequantize_with_the_scales() -> None:
    """The kernels alone (write, then attend) against dense attention over the dequantized
    keys and values, including a split-KV decode."""
    batch = make_batch([4, 1, 1], [4, 150, 37], 4, 2, 64, 16, seed=9)
    k_scale, v_scale = 0.5, 0.125
    _to_fp8(batch, k_scale, v_scale)
    # The new tokens are quantized by the kernel; the oracle sees them as it stores them.
    ctx = [s - q for q, s in zip(batch.q_lens, batch.seq_lens)]
    new_k = batch.key.cpu().split(batch.q_lens)
    new_v = batch.value.cpu().split(batch.q_lens)
    from vllm.attention.kv_cache_dtype import quantize_fp8

    for i, c in enumerate(ctx):
        batch.dense_k[i][c:] = quantize_fp8(new_k[i], k_scale).double() * k_scale
        batch.dense_v[i][c:] = quantize_fp8(new_v[i], v_scale).double() * v_scale
    md = batch.metadata
    n = md.num_actual_tokens
    for splits in (1, 2):
        cache = batch.kv_cache.clone()
        cache_ops.reshape_and_cache(batch.key, batch.value, cache, md.slot_mapping, n,
                                    k_scale=k_scale, v_scale=v_scale)
        out = torch.full_like(batch.query, float("nan"))
        attn_ops.unified_attention(
            batch.query, cache[0], cache[1], out, md.query_start_loc, md.seq_lens,
            md.block_table, num_tokens=n, num_reqs=md.num_reqs, max_query_len=md.max_query_len,
            max_seq_len=md.max_seq_len, scale=0.125, num_splits=splits, k_scale=k_scale,
            v_scale=v_scale,
        )
        assert rel_err(out, reference(batch, 0.125)) <= MAX_REL_ERR, splits


def test_fp8_cache_rejects_a_bad_scale() -> None:
    batch = make_batch([2], [2], 2, 1, 64, 16)
    _to_fp8(batch, 1.0, 1.0)
    md = batch.metadata
    with pytest.raises(ValueError, match="k_scale"):
        cache_ops.reshape_and_cache(batch.key, batch.value, batch.kv_cache, md.slot_mapping,
                                    k_scale=0.0)
    with pytest.raises(ValueError, match="v_scale"):
        attn_ops.unified_attention(
            batch.query, batch.kv_cache[0], batch.kv_cache[1], torch.empty_like(batch.query),
            md.query_start_loc, md.seq_lens, md.block_table, num_tokens=2, num_reqs=1,
            max_query_len=2, max_seq_len=2, scale=0.125, v_scale=float("nan"),
        )


def test_fp8_write_rounds_like_torch_everywhere() -> None:
    """Every e4m3 rounding case the write kernel meets (midpoints, where ties go to even,
    just either side of them, carries into the next power of two, subnormals, saturation)
    gives the value torch's own conversion gives."""
    from vllm.attention.kv_cache_dtype import FP8_DTYPE, FP8_MAX

    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = codes[codes.isfinite() & (codes >= 0)].unique()  # sorted, 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    nudge = (grid[1:] - grid[:-1]) / 64
    g = torch.Generator().manual_seed(2)
    wide = torch.exp(torch.empty(2048).uniform_(-12, 7, generator=g))  # 6e-6 .. 1100
    values = torch.cat([grid, mids, mids - nudge, mids + nudge, wide])
    values = torch.cat([values, -values])
    values = torch.cat([values, values.new_zeros((-values.numel()) % 64)]).view(-1, 1, 64)
    n = values.shape[0]
    cache = torch.zeros(2, n, 1, 1, 64, dtype=FP8_DTYPE, device=DEVICE)
    slots = torch.arange(n, dtype=torch.int64, device=DEVICE)
    cache_ops.reshape_and_cache(values.to(DEVICE), values.to(DEVICE), cache, slots)
    want = values.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    assert torch.equal(cache[0].cpu().view(torch.uint8), want.view(n, 1, 1, 64).view(torch.uint8))
