"""The LM head with a fresh logits tensor per step against one written into pooled memory.

    .venv/bin/python benchmarks/bench_logits_memory.py [--rows 64,256] [--hidden 256] \
        [--vocab 151936] [--iters 6]

A step's logits are [rows, vocab] float32. A fresh tensor of that size is mapped from the OS,
page-faulted in while the LM head writes it and unmapped when freed; the runner instead takes
a buffer from vllm/v1/worker/logits_buffers.py and the head writes into it (the same product,
the same bits). The two are run alternately in one process, so a shared machine's drift
touches both alike; min and median milliseconds per step and their ratio are printed.
"""

from __future__ import annotations

import argparse
import time

import torch

from vllm.model_executor.layers.vocab_embedding import ParallelLMHead
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor
from vllm.v1.worker.logits_buffers import LogitsBuffers


def main() -> None:
    """Times both ways at each row count and prints one line each."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="64,256")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--iters", type=int, default=6)
    args = parser.parse_args()
    head = ParallelLMHead(args.vocab, args.hidden)
    head.load_weight("weight", CheckpointTensor(torch.randn(args.vocab, args.hidden)))
    print(f"LM head [rows, {args.hidden}] x [{args.vocab}, {args.hidden}] float32, "
          f"torch threads {torch.get_num_threads()}; ms per step over {args.iters} steps")
    print(f"{'rows':>5} {'fresh min':>10} {'median':>8} {'pooled min':>11} {'median':>8} "
          f"{'fresh/pooled (min)':>19}")
    for rows in (int(r) for r in args.rows.split(",")):
        hidden = torch.randn(rows, args.hidden)
        pool = LogitsBuffers(args.vocab)
        fresh, pooled = [], []
        for _ in range(args.iters + 1):  # the first of each is a warm-up
            start = time.perf_counter()
            logits = head(hidden)
            logits.argmax(dim=1)  # read it, as sampling does
            del logits  # freed here, as when a step is sampled
            fresh.append(time.perf_counter() - start)
            start = time.perf_counter()
            buffer = pool.take(rows)
            logits = head(hidden, buffer)
            logits.argmax(dim=1)
            del logits
            pool.give(buffer)
            pooled.append(time.perf_counter() - start)
        fresh, pooled = sorted(fresh[1:]), sorted(pooled[1:])
        mid = len(fresh) // 2
        print(f"{rows:5d} {fresh[0] * 1e3:10.1f} {fresh[mid] * 1e3:8.1f} "
              f"{pooled[0] * 1e3:11.1f} {pooled[mid] * 1e3:8.1f} {fresh[0] / pooled[0]:19.2f}")


if __name__ == "__main__":
    main()
