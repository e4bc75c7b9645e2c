"""Times the attention backends: Triton against torch on CUDA, and on the CPU the torch
backend's decodes (native kernel, tiled torch) against the whole-context gather they replaced
and the bare loop's SDPA.

Run: `.venv/bin/python benchmarks/bench_attention.py [--cpu] [--iters N]`.

On CUDA: Qwen3-1.7B-like attention (16 query heads, 8 KV heads, head size 128), block size
16, bf16: decode batches of 1, 64 and 256 requests at contexts 512-2048, and a mixed batch of
prefills, a prefill chunk over cached context and decodes. Prints milliseconds per forward
(median, one layer) and the speedup; forward includes writing the new K/V into the cache.

With `--cpu` (the default without CUDA): the demo model's attention (4 query heads, 2 KV
heads, head size 64; `--heads 16,8,128` for another), block size 16, float32, decode batches
of 1, 16 and 64 at contexts 128, 1k, 4k and 8k (cells over `--max-cell-tokens` are
skipped), with a float8 cache at 4k. "gather" copies every request's whole paged context
into one tensor per layer before multiplying (the torch backend until the tiled decode);
"tiled" is TorchAttentionBackend's torch decode (its path without the native library, and
for float8); "native" is TorchAttentionBackend with the native kernel that reads the paged
cache in place; "sdpa" is the bare decode loop's attention: one
scaled_dot_product_attention over contexts already contiguous (the ceiling). The variants
alternate within each cell; the fastest forward of each is kept (the CPU may be shared), and
the largest output difference from "gather" is printed, then geometric means of the ratios.

OpenMP's wait policy changes the CPU figures several-fold for the tiled decode (many small
operations): the engine sleeps idle OpenMP threads (PASSIVE) when its team takes every CPU
(vllm/thread_policy.py), so to time what the engine sees there, run with
`OMP_WAIT_POLICY=PASSIVE` and `--threads` equal to the CPUs.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm import _custom_ops
from vllm.attention.backends.abstract import AttentionBackend, AttentionMetadata
from vllm.attention.backends.torch_backend import TorchAttentionBackend, gather_kv
from vllm.attention.kv_cache_dtype import FP8_DTYPE

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 16, 8, 128, 16


def make_inputs(
    q_lens: list[int], seq_lens: list[int], device: torch.device, dtype: torch.dtype,
    heads: tuple[int, int, int] = (NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE),
    cache_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random query/key/value, a filled paged cache (of cache_dtype, default dtype) and
    metadata for one batch; heads: (query heads, KV heads, head size)."""
    num_heads, num_kv_heads, head_size = heads
    g = torch.Generator(device="cpu").manual_seed(0)
    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(q_lens), max(blocks), dtype=torch.int32)
    slots = []
    used = 0
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        ids = perm[used : used + blocks[i]]
        used += blocks[i]
        table[i, : blocks[i]] = ids.to(torch.int32)
        pos = torch.arange(seq_len - q_len, seq_len)
        slots.append(ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    num_tokens = sum(q_lens)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_size, dtype=dtype,
                           device=device).to(cache_dtype or dtype)
    query = torch.randn(num_tokens, num_heads, head_size, dtype=dtype, device=device)
    key = torch.randn(num_tokens, num_kv_heads, head_size, dtype=dtype, device=device)
    value = torch.randn_like(key)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=len(q_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=qsl.to(device),
        seq_lens=lens.to(device),
        block_table=table.to(device),
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    )
    return query, key, value, kv_cache, metadata


def time_ms(backend: AttentionBackend, inputs: tuple, iters: int) -> tuple[float, torch.Tensor]:
    """Median wall time of one forward in ms (host work included) and its output."""
    query, key, value, kv_cache, metadata = inputs
    out = backend.forward(query, key, value, kv_cache, metadata)
    for _ in range(3):
        backend.forward(query, key, value, kv_cache, metadata)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        backend.forward(query, key, value, kv_cache, metadata)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], out


def run_case(name: str, q_lens: list[int], seq_lens: list[int], iters: int) -> None:
    """Prints the Triton and torch times for one batch and their output difference."""
    from vllm.attention.backends.triton_backend import TritonAttentionBackend

    device = torch.device("cuda")
    inputs = make_inputs(q_lens, seq_lens, device, torch.bfloat16)
    scale = HEAD_SIZE**-0.5
    row = f"{name:38s}"
    outs = {}
    variants: list[tuple[str, AttentionBackend]] = [
        ("triton", TritonAttentionBackend(NUM_HEADS, HEAD_SIZE, NUM_KV_HEADS, scale)),
        ("nosplit", TritonAttentionBackend(NUM_HEADS, HEAD_SIZE, NUM_KV_HEADS, scale, 1)),
        ("torch", TorchAttentionBackend(NUM_HEADS, HEAD_SIZE, NUM_KV_HEADS, scale)),
    ]
    times = {}
    for label, backend in variants:
        times[label], outs[label] = time_ms(backend, inputs, iters)
        row += f" {label} {times[label]:8.3f} ms"
    diff = (outs["triton"].float() - outs["torch"].float()).abs().max().item()
    row += f"  speedup {times['torch'] / times['triton']:6.2f}x  max|diff| {diff:.3g}"
    print(row, flush=True)


@dataclass
class _Bucket:
    """Decode requests of one padded context length (the gather baseline's plan)."""

    token_idx: torch.Tensor
    block_ids: torch.Tensor
    length: int
    hidden: torch.Tensor


class GatherAttentionBackend(TorchAttentionBackend):
    """The torch backend with the decode it had before tiling: per bucket of requests padded
    to the same context length, every request's whole context is gathered into one tensor,
    then multiplied per KV head. Prefills are the torch backend's. The baseline of --cpu."""

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """See AttentionBackend.attend."""
        out = torch.zeros_like(query)
        starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        buckets: dict[int, list[int]] = {}
        for i in range(metadata.num_reqs):
            query_len = starts[i + 1] - starts[i]
            if query_len == 1:
                buckets.setdefault(-(-seq_lens[i] // 64) * 64, []).append(i)
            elif query_len > 1:
                self._prefill(query, kv_cache, metadata, out, i, starts[i], query_len,
                              seq_lens[i])
        block_size = kv_cache.shape[2]
        for longest, reqs in buckets.items():
            num_blocks = min(-(-longest // block_size), metadata.block_table.shape[1])
            length = min(longest, num_blocks * block_size)
            lens = torch.tensor([seq_lens[i] for i in reqs])
            visible = torch.arange(length)[None, :] < lens[:, None]
            bucket = _Bucket(torch.tensor([starts[i] for i in reqs]),
                             metadata.block_table[reqs, :num_blocks].clamp(min=0).long(),
                             length, ~visible[:, None, None, :])
            self._gather_decode(query, kv_cache, out, bucket)
        return out

    def _gather_decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, bucket: _Bucket
    ) -> None:
        k, v = gather_kv(kv_cache, bucket.block_ids, bucket.length)
        batch, group = len(bucket.token_idx), self.num_heads // self.num_kv_heads
        q = query[bucket.token_idx].view(batch, self.num_kv_heads, group, self.head_size)
        k, v = k.to(q.dtype), v.to(q.dtype)
        if batch == 1:
            q, k, v = torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v])
        heads = range(self.num_kv_heads)
        scores = torch.stack([torch.bmm(q[:, h], k[:, :, h].transpose(1, 2)) for h in heads], 1)
        score_scale, out_scale = self._read_scales(kv_cache)
        scores = (scores * score_scale).masked_fill_(bucket.hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.stack([torch.bmm(probs[:, h], v[:, :, h]) for h in heads], 1)[:batch]
        if out_scale != 1.0:
            o = o * out_scale
        out.index_copy_(0, bucket.token_idx, o.reshape(batch, self.num_heads, self.head_size))


class TiledAttentionBackend(TorchAttentionBackend):
    """The torch backend with its tiled decode even where the native kernel would run (what
    a build without the native library uses)."""

    def _native_decode(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return False


def run_cpu_case(batch: int, context: int, heads: tuple[int, int, int], iters: int,
                 cache_dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Prints the decode times of one batch per variant; returns each one's ms."""
    inputs = make_inputs([1] * batch, [context] * batch, torch.device("cpu"), torch.float32,
                         heads, cache_dtype)
    query, key, value, kv_cache, metadata = inputs
    num_heads, num_kv_heads, head_size = heads
    scale = head_size**-0.5
    variants = {
        "gather": GatherAttentionBackend(num_heads, head_size, num_kv_heads, scale).forward,
        "tiled": TiledAttentionBackend(num_heads, head_size, num_kv_heads, scale).forward,
    }
    if cache_dtype == torch.float32 and _custom_ops.HAS_NATIVE:
        variants["native"] = TorchAttentionBackend(num_heads, head_size, num_kv_heads,
                                                   scale).forward
        # The bare loop's attention: each request's context already contiguous (gathered once,
        # untimed), one SDPA call for the batch; the cache write is not part of it.
        blocks = -(-context // BLOCK_SIZE)
        k, v = (t.transpose(1, 2).contiguous() for t in gather_kv(
            kv_cache, metadata.block_table[:, :blocks], context))
        q = query.view(batch, 1, num_heads, head_size).transpose(1, 2)
        variants["sdpa"] = lambda *args: F.scaled_dot_product_attention(
            q, k, v, scale=scale, enable_gqa=num_heads != num_kv_heads
        ).transpose(1, 2).reshape(batch, num_heads, head_size)
    best = {name: float("inf") for name in variants}
    outs = {}
    for i in range(iters + 1):
        for name, forward in variants.items():
            metadata.backend_plans.clear()  # the plan is made once per forward pass
            start = time.perf_counter()
            outs[name] = forward(query, key, value, kv_cache, metadata)
            if i:  # the first round warms up
                best[name] = min(best[name], 1e3 * (time.perf_counter() - start))
    # "sdpa" read the contexts before this step's keys and values were cached: not compared.
    diff = max((outs["gather"] - o).abs().max().item() for name, o in outs.items()
               if name != "sdpa")
    dtype = "fp8 " if cache_dtype == FP8_DTYPE else ""
    times = "  ".join(f"{name} {ms:8.3f}" for name, ms in best.items())
    print(f"decode {dtype}batch {batch:3d} context {context:5d}  ms: {times}  "
          f"max|diff| {diff:.2g}", flush=True)
    return best


def run_cpu(heads: tuple[int, int, int], iters: int, max_cell_tokens: int) -> None:
    """The --cpu table: every (batch, context) cell within max_cell_tokens, then fp8; then
    geometric means of the ratios between variants."""
    print(f"CPU, {torch.get_num_threads()} threads: heads {heads[0]}/{heads[1]}, head_size "
          f"{heads[2]}, block {BLOCK_SIZE}, float32; one layer's forward, fastest of {iters}")
    cells = []
    for context in (128, 1024, 4096, 8192):
        for batch in (1, 16, 64):
            if batch * context <= max_cell_tokens:
                cells.append(run_cpu_case(batch, context, heads, iters))
    for batch in (1, 16):
        cells.append(run_cpu_case(batch, 4096, heads, iters, FP8_DTYPE))
    for slow, fast in (("gather", "tiled"), ("tiled", "native"), ("sdpa", "native")):
        ratios = [c[slow] / c[fast] for c in cells if slow in c and fast in c]
        if ratios:
            geo = torch.tensor(ratios).log().mean().exp().item()
            print(f"geometric mean {slow}/{fast} over {len(ratios)} cells: {geo:.2f}x "
                  f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x)")


def main() -> int:
    """Runs every case; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20, help="timed forwards per case")
    parser.add_argument("--cpu", action="store_true", help="the CPU table (default without CUDA)")
    parser.add_argument("--heads", default="4,2,64",
                        help="--cpu: query heads, KV heads, head size")
    parser.add_argument("--max-cell-tokens", type=int, default=1 << 19,
                        help="--cpu: skip cells whose batch × context exceeds this")
    parser.add_argument("--threads", type=int, default=None,
                        help="--cpu: torch threads (default torch's; 1 is steadier on a "
                        "shared machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu or not torch.cuda.is_available():
        heads = tuple(int(x) for x in args.heads.split(","))
        if len(heads) != 3:
            parser.error(f"--heads: expected three integers, got {args.heads!r}")
        run_cpu(heads, args.iters, args.max_cell_tokens)  # type: ignore[arg-type]
        return 0
    print(f"{torch.cuda.get_device_name()}: heads {NUM_HEADS}/{NUM_KV_HEADS}, head_size "
          f"{HEAD_SIZE}, block {BLOCK_SIZE}, bf16; triton = heuristic split-KV, nosplit = never")
    for batch in (1, 64, 256):
        for context in (512, 1024, 2048):
            run_case(f"decode batch {batch:3d} context {context:4d}", [1] * batch,
                     [context] * batch, args.iters)
    # 4 fresh 512-token prefills, a 512-token chunk over 1536 cached, 64 decodes at 1024.
    q_lens = [512] * 4 + [512] + [1] * 64
    seq_lens = [512] * 4 + [2048] + [1024] * 64
    run_case("mixed 2624 tokens (prefill+decode)", q_lens, seq_lens, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
