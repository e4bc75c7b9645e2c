"""Times vllm._custom_ops native vs numpy for the runner's per-step input preparation.

Run: `.venv/bin/python benchmarks/bench_custom_ops.py`. Prints microseconds per call (best of
several repeats) for a decode-like batch (T=256, one token per request) and a prefill-like
batch (T=8192 over 16 requests).
"""

from __future__ import annotations

import timeit
from collections.abc import Callable

import numpy as np

import vllm._custom_ops as ops


def best_us(fn: Callable[[], None], number: int = 2000, repeat: int = 7) -> float:
    """Best per-call time of fn in microseconds."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def bench(tokens: int, num_reqs: int, block_size: int = 16) -> None:
    """Prints per-call times of both ops, native and numpy, for one batch shape."""
    rng = np.random.default_rng(0)
    max_blocks = 2048
    table = rng.integers(0, 100_000, size=(1024, max_blocks), dtype=np.int32)
    scheduled = np.full(num_reqs, tokens // num_reqs, dtype=np.int32)
    computed = rng.integers(0, 4096, size=num_reqs, dtype=np.int32)
    reqs = np.zeros(tokens, dtype=np.int32)
    positions = np.zeros(tokens, dtype=np.int64)
    out = np.zeros(tokens, dtype=np.int64)
    ops.prepare_positions(computed, scheduled, reqs, positions)
    impls = {"numpy": ops._NUMPY_OPS}
    if ops.HAS_NATIVE:
        impls["native"] = ops._NATIVE_OPS
    number = 20000 if tokens <= 512 else 1000
    chosen = ops._ops
    for name, impl in impls.items():
        # Timed through the public ops, argument checks included, as the runner calls them.
        ops._ops = lambda: impl
        try:
            t_prep = best_us(lambda: ops.prepare_positions(computed, scheduled, reqs, positions),
                             number)
            t_slot = best_us(
                lambda: ops.compute_slot_mapping(table, reqs, positions, block_size, out), number
            )
        finally:
            ops._ops = chosen
        print(f"T={tokens:5d} R={num_reqs:4d} {name:6s} prepare_positions {t_prep:7.2f} us"
              f"   compute_slot_mapping {t_slot:7.2f} us")


def main() -> None:
    """Runs the two batch shapes."""
    print(f"HAS_NATIVE={ops.HAS_NATIVE}")
    bench(256, 256)
    bench(8192, 16)


if __name__ == "__main__":
    main()
