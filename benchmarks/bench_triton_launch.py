"""Host cost of one launch of each of the engine's Triton kernels (outside CUDA graphs).

    python benchmarks/bench_triton_launch.py [--iters 200] [--batch 64] [--json RESULT.json]

Each kernel is called through the wrapper the engine calls, at decode-like shapes of the
Qwen3-1.7B config (16 query heads, 8 KV heads, head size 128, 16-token blocks, 512-token
contexts; 2048 x 2048 for the 4-bit matmul; 8 experts of 768 x 2048, two per token, for the
grouped GEMM): after warm-up calls (compilation, autotuning), --iters calls are queued
without a synchronisation and the host's time per call is reported (`host_us`), then the
time per call including the device's work once it has drained (`wall_us`). A torch
elementwise op is the baseline. Inside a CUDA graph none of this host time is paid, so it
is what eager steps (prefill, mixed batches) pay per kernel per layer.

Without CUDA, run with TRITON_INTERPRET=1: the kernels run in Triton's interpreter on tiny
shapes, and the numbers only show the mechanics work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def _attention_calls(dev: torch.device, batch: int, tiny: bool) -> dict[str, Callable[[], None]]:
    from vllm.attention.ops.triton_reshape_and_cache import reshape_and_cache
    from vllm.attention.ops.triton_unified_attention import unified_attention

    heads, kv_heads, head, block, context = (2, 1, 16, 16, 32) if tiny else (16, 8, 128, 16, 512)
    dtype = torch.float32 if tiny else torch.bfloat16
    blocks_per_seq = context // block
    num_blocks = batch * blocks_per_seq
    cache = torch.zeros(2, num_blocks, block, kv_heads, head, dtype=dtype, device=dev)
    key = torch.randn(batch, kv_heads, head, dtype=dtype, device=dev)
    slots = torch.arange(batch, device=dev, dtype=torch.int64) * context + context - 1
    query = torch.randn(batch, heads, head, dtype=dtype, device=dev)
    out = torch.empty_like(query)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    table = torch.arange(num_blocks, dtype=torch.int32, device=dev).view(batch, blocks_per_seq)
    return {
        "reshape_and_cache": lambda: reshape_and_cache(key, key, cache, slots),
        "unified_attention (decode)": lambda: unified_attention(
            query, cache[0], cache[1], out, starts, seq_lens, table, num_tokens=batch,
            num_reqs=batch, max_query_len=1, max_seq_len=context, scale=head ** -0.5),
    }


def _matmul_calls(dev: torch.device, batch: int, tiny: bool) -> dict[str, Callable[[], None]]:
    from vllm.model_executor.layers.quantization.int4_triton import int4_matmul
    from vllm.model_executor.layers.triton_grouped_gemm import (
        align_by_expert,
        grouped_gemm,
    )

    size, group = (64, 32) if tiny else (2048, 128)
    dtype = torch.float32 if tiny else torch.bfloat16
    x = torch.randn(batch, size, dtype=dtype, device=dev)
    words = torch.zeros(size, size // 8, dtype=torch.int32, device=dev)
    scales = torch.ones(size, size // group, dtype=dtype, device=dev)
    experts, inter, top_k = (4, 32, 2) if tiny else (8, 768, 2)
    w = torch.randn(experts, inter, size, dtype=dtype, device=dev)
    ids = torch.randint(0, experts, (batch, top_k), device=dev)
    pair_ids, block_expert = align_by_expert(ids, experts, 16)
    return {
        "int4_matmul": lambda: int4_matmul(x, words, (size // 8, 1), scales, (size // group, 1),
                                           size, 8, group_size=group),
        "grouped_gemm (MoE up)": lambda: grouped_gemm(x, top_k, w, pair_ids, block_expert,
                                                     batch * top_k),
    }


def _time(call: Callable[[], None], iters: int, warmup: int, cuda: bool) -> tuple[float, float]:
    """(host us per call, us per call once the device has drained)."""
    for _ in range(warmup):
        call()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    queued = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    done = time.perf_counter()
    return (queued - start) / iters * 1e6, (done - start) / iters * 1e6


def measure(iters: int = 200, batch: int = 64, warmup: int = 3,
            only: set[str] | None = None) -> list[dict]:
    """Rows {kernel, host_us, wall_us} for the baseline and every kernel (module docstring),
    or only those named in `only`; tiny shapes and the interpreter without CUDA."""
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    tiny = not cuda
    batch = 2 if tiny else batch
    baseline = torch.zeros(batch, 2048, device=dev)
    calls = {"torch add_ (baseline)": lambda: baseline.add_(1.0)}
    calls.update(_attention_calls(dev, batch, tiny))
    calls.update(_matmul_calls(dev, batch, tiny))
    rows = []
    with torch.inference_mode():
        for name, call in calls.items():
            if only is not None and name not in only:
                continue
            host, wall = _time(call, iters, warmup, cuda)
            rows.append({"kernel": name, "host_us": round(host, 2), "wall_us": round(wall, 2)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = measure(args.iters if torch.cuda.is_available() else 2, args.batch)
    print(f"{'kernel':30s} {'host us/call':>14s} {'us/call with device':>20s}")
    for row in rows:
        print(f"{row['kernel']:30s} {row['host_us']:14.1f} {row['wall_us']:20.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
