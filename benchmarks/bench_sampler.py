"""Prints milliseconds per Sampler step for [256, 151936] float32 logits (not a test).

Usage: python benchmarks/bench_sampler.py [--rows 256] [--vocab 151936] [--iters 3]
                                           [--device cpu|cuda]

The logits are LM-like (z-scores times 4, so the top 1024 tokens hold ~94% of the mass and
top-p 0.9 needs no full sort), plus one case where every row's nucleus is wider than the
candidates (the full-sort fallback) measured on a few rows.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from vllm import _custom_ops as ops
from vllm.v1.sample.metadata import GrammarMask, SamplingMetadata
from vllm.v1.sample.sampler import Sampler


def metadata(n: int, device: torch.device, **fields) -> SamplingMetadata:
    """Metadata for n unseeded rows at temperature 0.8 with `fields` overridden."""
    fields.setdefault("output_positions", [7] * n)
    return SamplingMetadata.plain(
        torch.full((n,), 0.8, device=device),
        torch.Generator(device=device).manual_seed(0),
        **fields,
    )


def cases(n: int, device: torch.device) -> dict[str, SamplingMetadata]:
    """The benchmarked configurations by name."""
    greedy = metadata(n, device, temperature=None, all_greedy=True, all_random=False)
    return {
        "greedy": greedy,
        "temperature only": metadata(n, device),
        "top-k 50": metadata(
            n, device, top_k=torch.full((n,), 50, dtype=torch.int32, device=device)
        ),
        "top-p 0.9": metadata(n, device, top_p=torch.full((n,), 0.9, device=device)),
        "min-p 0.05": metadata(n, device, min_p=torch.full((n,), 0.05, device=device)),
        "seeded rows (all)": metadata(n, device, seeds=list(range(n))),
        "greedy + logprobs 5": metadata(
            n, device, temperature=None, all_greedy=True, all_random=False, max_num_logprobs=5
        ),
    }


def json_like_mask(n: int, vocab: int, seed: int = 0) -> GrammarMask:
    """Masks shaped like a JSON grammar's: half the rows inside a string (nearly every token
    allowed), half between values (a few dozen tokens allowed)."""
    rng = np.random.default_rng(seed)
    words = (vocab + 31) // 32
    bits = np.zeros((n, words), dtype=np.int32)
    bits[::2] = -1
    bits[::2, rng.integers(0, words, words // 50)] = 0  # quotes, controls
    words_view = bits.view(np.uint32)
    for r in range(1, n, 2):
        allowed = rng.integers(0, vocab, 40)
        one_bits = np.left_shift(np.uint32(1), (allowed % 32).astype(np.uint32))
        np.bitwise_or.at(words_view[r], allowed // 32, one_bits)
    return GrammarMask(bits, np.arange(n, dtype=np.int64))


class Reference:
    """The greedy path before the fused kernel: the mask written as -inf into the logits
    (in place: writing the same mask again costs the same and changes nothing), then
    torch's argmax per chunk of ~4 MiB."""

    def __init__(self, grammar: GrammarMask | None) -> None:
        self.grammar = grammar

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        x = logits
        if self.grammar is not None:
            rows = self.grammar.rows
            ops.apply_token_bitmask(x.numpy(), self.grammar.bitmask, rows, rows)
        step = max(1, (1 << 20) // x.shape[1])
        return torch.cat([x[lo : lo + step].argmax(dim=1) for lo in range(0, len(x), step)])


def timed(
    sampler, logits: torch.Tensor, md: SamplingMetadata, iters: int
) -> tuple[float, float, float]:
    """(min wall, median wall, min process CPU) milliseconds of `iters` steps after one
    warm-up step. On a shared machine the minimum is the better estimate of the uncontended
    cost, and with --threads 1 the CPU time is nearly immune to other processes."""
    sampler(logits, md)
    wall, cpu = [], []
    for _ in range(iters):
        if logits.is_cuda:
            torch.cuda.synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        sampler(logits, md)
        if logits.is_cuda:
            torch.cuda.synchronize()
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    wall.sort()
    return wall[0], wall[len(wall) // 2], min(cpu)


def main() -> None:
    """Runs every case and prints one line each."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(1)
    logits = torch.randn(args.rows, args.vocab, generator=gen, device=device) * 4.0
    sampler = Sampler()
    print(
        f"logits [{args.rows}, {args.vocab}] float32 on {device}, torch threads "
        f"{torch.get_num_threads()}; ms per step over {args.iters} steps:"
    )
    print(f"{'case':>22}  {'min wall':>9} {'median':>9} {'min cpu':>9}")
    for name, md in cases(args.rows, device).items():
        best, median, cpu = timed(sampler, logits, md, args.iters)
        print(f"{name:>22}: {best:9.1f} {median:9.1f} {cpu:9.1f}")
    if device.type == "cpu":
        # Old and new greedy paths side by side (same run, same logits; the old one masks
        # `logits` in place, so the fused one reads an unmasked copy).
        grammar = json_like_mask(args.rows, args.vocab)
        greedy = metadata(args.rows, device, temperature=None, all_greedy=True,
                          all_random=False)
        masked = metadata(args.rows, device, temperature=None, all_greedy=True,
                          all_random=False, grammar_mask=grammar)
        copy = logits.clone()
        pairs = {
            "greedy": (Reference(None), sampler, greedy),
            "greedy + JSON mask": (Reference(grammar), sampler, masked),
        }
        for name, (old, new, md) in pairs.items():
            old_ms = timed(old, logits, md, args.iters)[0]
            new_ms = timed(new, copy, md, args.iters)[0]
            print(f"{name:>22}: torch argmax {old_ms:7.1f}  fused {new_ms:7.1f}  "
                  f"(min wall; {old_ms / new_ms:.1f}x)")
    few = min(8, args.rows)
    flat = torch.randn(few, args.vocab, generator=gen, device=device)
    md = metadata(few, device, top_p=torch.full((few,), 0.9, device=device))
    best, median, cpu = timed(sampler, flat, md, args.iters)
    print(
        f"{'top-p full sort, /row':>22}: {best / few:9.1f} {median / few:9.1f} {cpu / few:9.1f}"
        "  (nucleus > 1024 tokens)"
    )


if __name__ == "__main__":
    main()
