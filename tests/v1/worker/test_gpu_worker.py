"""KV cache sizing (vllm/v1/worker/gpu_worker.py), with the device's memory passed in."""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import kv_cache_blocks

GiB = 1 << 30
BLOCK_BYTES = 1 << 20  # 1 MiB per block of 16 tokens
H200 = 140 * GiB


def _blocks(**kw) -> int:
    args = dict(block_bytes=BLOCK_BYTES, block_size=16, max_num_seqs=8, max_model_len=128,
                kv_cache_memory=None, gpu_memory_utilization=0.9, free=None, total=None)
    args.update(kw)
    return kv_cache_blocks(**args)


def test_a_small_engine_takes_only_what_its_sequences_can_fill() -> None:
    # 8 sequences × 128 tokens = 64 blocks, on an empty GPU: the engine must not take 120 GiB,
    # or a second engine in the same process (the GPU suite builds several) gets no cache.
    assert _blocks(free=H200, total=H200) == 64
    # The second engine still finds its 64 blocks.
    used_by_first = 2 * GiB
    assert _blocks(free=H200 - used_by_first, total=H200) == 64


def test_a_large_engine_takes_the_fraction_minus_what_others_hold() -> None:
    big = dict(max_num_seqs=1024, max_model_len=4096)  # wants 256 GiB
    held = 10 * GiB  # weights and anything else already on the device
    expected = (int(H200 * 0.9) - held - GiB) // BLOCK_BYTES
    assert _blocks(free=H200 - held, total=H200, **big) == expected
    # What is already taken counts against --gpu-memory-utilization.
    assert _blocks(free=int(H200 * 0.05), total=H200, **big) == 0
    # So does what the runner allocates after the cache (the post-layer request tables).
    reserved = 3 * GiB
    assert _blocks(free=H200 - held, total=H200, reserved=reserved, **big) == (
        expected - reserved // BLOCK_BYTES)


def test_kv_cache_memory_wins_on_every_device() -> None:
    assert _blocks(kv_cache_memory=3 * GiB, free=H200, total=H200) == 3 * 1024
    assert _blocks(kv_cache_memory=3 * GiB) == 3 * 1024


def test_cpu_default_is_two_gib_at_most() -> None:
    assert _blocks() == 64
    assert _blocks(max_num_seqs=1024, max_model_len=4096) == 2 * 1024


def test_one_full_length_sequence_always_fits() -> None:
    # 1000 tokens in blocks of 16 need 63 blocks, not 1000 // 16 = 62 (which held 992 tokens
    # and made the engine refuse to start).
    blocks = _blocks(max_num_seqs=1, max_model_len=1000, free=H200, total=H200)
    assert blocks * 16 >= 1000
    assert _blocks(max_num_seqs=1, max_model_len=1000) * 16 >= 1000
