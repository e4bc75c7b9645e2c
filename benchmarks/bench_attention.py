"""Times TritonAttentionBackend against TorchAttentionBackend on CUDA.

Run: `.venv/bin/python benchmarks/bench_attention.py`. Uses Qwen3-1.7B-like attention (16
query heads, 8 KV heads, head size 128), block size 16, bf16: decode batches of 1, 64 and
256 requests at contexts 512-2048, and a mixed batch of prefills, a prefill chunk over
cached context and decodes. Prints milliseconds per forward (median, one layer) and the
speedup; forward includes writing the new K/V into the cache. Without CUDA it says so and
exits 0.
"""

from __future__ import annotations

import argparse
import sys

import torch

from vllm.attention.backends.abstract import AttentionBackend, AttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 16, 8, 128, 16


def make_inputs(
    q_lens: list[int], seq_lens: list[int], device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random query/key/value, a filled paged cache and metadata for one batch."""
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
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype,
                           device=device)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, dtype=dtype, device=device)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype, device=device)
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
    from vllm.attention.backends.torch_backend import TorchAttentionBackend
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


def main() -> int:
    """Runs every case; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20, help="timed forwards per case")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention.py needs a CUDA device; none found, nothing to do.")
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
