"""Throughput and time per output token against batch size and context length, for the
engine and for the bare decode loop over the same checkpoint, in one run, with a PNG chart.

    .venv/bin/python benchmarks/bench_scaling.py [--model demo] [--batch-sizes 1,4,16,64] \
        [--context-lens 128,1024] [--output-len 32] [--max-cell-tokens N] [--repeats 1] \
        [--png results/scaling.png] [--json F]

On a GPU, e.g. `--batch-sizes 1,8,32,128,256 --context-lens 128,1024,8192`. Prompts are
seeded random token ids of exactly the context length; outputs are greedy with ignore_eos.
Each cell runs the full output and a one-token output (the prefill); the difference divided
by the remaining steps is the time per decode step. The engine's own cost per step is its
step time minus the bare loop's; the benchmark prints how that overhead grows with the
batch (the exponent of a power law through the smallest and largest batch: 1.0 is linear),
and engine ÷ bare throughput per cell. `--max-cell-tokens` skips the cells whose batch times
context exceeds it (on a CPU, e.g. 65536 keeps batch 256 at context 128 and batch 8 at 8k);
skipped cells are gaps in the chart. With `--repeats N` each cell runs engine and bare loop
alternately N times: step times are medians, and engine ÷ bare is the median (min-max) of
the N paired ratios, steadier on a shared machine than one pair (one pair swung by 2x there).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench_offline import paired_ratios, spread  # the sibling script
from vllm import LLM, SamplingParams, thread_policy
from vllm.benchmarks.plot import line_chart_png


def step_seconds(full_s: float, prefill_s: float, output_len: int) -> float:
    """Seconds per decode step: the time beyond the prefill, over the steps after the first
    token. Raises ValueError for an output of fewer than two tokens."""
    if output_len < 2:
        raise ValueError(f"output_len: need at least 2 tokens, got {output_len}")
    return max(full_s - prefill_s, 0.0) / (output_len - 1)


def growth_exponent(batches: list[int], overheads: list[float]) -> float | None:
    """k in overhead ∝ batch^k through the smallest and largest batch (None when either
    overhead is not positive or there is one batch)."""
    (b0, o0), (b1, o1) = min(zip(batches, overheads)), max(zip(batches, overheads))
    if b1 == b0 or o0 <= 0 or o1 <= 0:
        return None
    return math.log(o1 / o0) / math.log(b1 / b0)


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(batch)]


def _timed(fn: Any) -> float:
    import torch

    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def summarize(context: int, batch: int, engine_steps: list[float],
              bare_steps: list[float]) -> dict[str, Any]:
    """A cell's record from its repeats' decode step times in seconds (engine and bare loop,
    paired by repeat): median step times, throughputs and engine ÷ bare, and the ratio of
    each pair (a step of 0 s, a decode drowned in noise, gives no ratio)."""
    e_step, b_step = statistics.median(engine_steps), statistics.median(bare_steps)
    pairs = [(b, e) for e, b in zip(engine_steps, bare_steps, strict=True) if e and b]
    ratios = paired_ratios([b for b, _ in pairs], [e for _, e in pairs])
    return {
        "context": context, "batch": batch,
        "engine_step_ms": 1e3 * e_step, "bare_step_ms": 1e3 * b_step,
        "overhead_step_ms": 1e3 * (e_step - b_step),
        # No throughput for a cell whose median step is 0 s: a gap in the chart.
        "engine_tok_s": batch / e_step if e_step else math.nan,
        "bare_tok_s": batch / b_step if b_step else math.nan,
        "engine_over_bare": statistics.median(ratios) if ratios else math.nan,
        "engine_over_bare_each": ratios,
    }


def cells(batches: list[int], lengths: list[int], max_tokens: int | None) -> list[tuple[int, int]]:
    """The (context length, batch) pairs to run: every pair whose batch × context is at most
    max_tokens (None: every pair), by context then batch."""
    return [(n, b) for n in sorted(lengths) for b in sorted(batches)
            if max_tokens is None or n * b <= max_tokens]


def run(model: str, grid: list[tuple[int, int]], output_len: int,
        repeats: int = 1) -> list[dict]:
    """One record per (context length, batch) of grid (`summarize`), each cell run
    `repeats` times, engine and bare loop alternately."""
    # The engine's thread policy before torch loads OpenMP (as `LLM` would set it): loaded
    # first, OpenMP's idle threads spin on the cores the engine's Python threads need
    # (vllm/thread_policy.py), which cost the engine up to 15% per step at 8k context. The
    # bare loop runs under the same policy.
    thread_policy.configure_process()
    import torch

    from vllm.model_executor.greedy_decode_loop import BareDecoder
    from vllm.transformers_utils.hub import resolve_model_path

    model_dir = resolve_model_path(model)
    cuda = torch.cuda.is_available()
    bare = BareDecoder(model_dir, dtype=torch.bfloat16 if cuda else torch.float32,
                       device="cuda" if cuda else "cpu")
    vocab = bare.head.shape[0] - 1024  # stay below Qwen's added tokens and the padding
    records = []
    for length in sorted({n for n, _ in grid}):
        batches = [b for n, b in grid if n == length]
        # Synchronous steps: the engine's own cost per step is what this measures, and async
        # scheduling would hide part of it behind the forward pass.
        # Every prompt of a batch is prefilled in the first step: with a smaller budget the
        # full run's first decode steps would share their steps with later prompts' prefill
        # chunks, which the one-token run does not, and the difference would count them.
        llm = LLM(model, max_model_len=length + output_len + 16, max_num_seqs=max(batches),
                  max_num_batched_tokens=max(8192, length * max(batches)),
                  enable_prefix_caching=False, async_scheduling=False)
        try:
            for batch in batches:
                prompts = _prompts(batch, length, vocab, seed=batch * 7919 + length)
                inputs = [{"prompt_token_ids": p} for p in prompts]

                def engine(n: int) -> None:
                    llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=n,
                                                        ignore_eos=True), use_tqdm=False)

                engine(2)  # warm up this shape
                bare.generate(prompts[:1], 2)
                engine_steps, bare_steps = [], []
                for _ in range(repeats):
                    e_full, e_pre = _timed(lambda: engine(output_len)), _timed(lambda: engine(1))
                    b_full = _timed(lambda: bare.generate(prompts, output_len))
                    b_pre = _timed(lambda: bare.generate(prompts, 1))
                    engine_steps.append(step_seconds(e_full, e_pre, output_len))
                    bare_steps.append(step_seconds(b_full, b_pre, output_len))
                record = summarize(length, batch, engine_steps, bare_steps)
                records.append(record)
                ratios = record["engine_over_bare_each"]
                ratio = spread(ratios) if len(ratios) > 1 else f"{record['engine_over_bare']:5.2f}"
                print(f"context {length:6d} batch {batch:4d}: engine "
                      f"{record['engine_step_ms']:8.2f} ms/step "
                      f"({record['engine_tok_s']:8.1f} tok/s), bare "
                      f"{record['bare_step_ms']:8.2f} ms/step ({record['bare_tok_s']:8.1f} tok/s),"
                      f" overhead {record['overhead_step_ms']:7.2f} ms/step, engine/bare {ratio}",
                      flush=True)
        finally:
            llm.shutdown()
    return records


def chart(records: list[dict], path: Path) -> Path:
    """Tokens/s against batch size: one engine line and one bare line per context length
    (a batch not run at a context is a gap)."""
    batches = sorted({r["batch"] for r in records})
    series: dict[str, list[float]] = {}
    for length in sorted({r["context"] for r in records}):
        rows = {r["batch"]: r for r in records if r["context"] == length}
        for who in ("engine", "bare"):
            series[f"{who}, context {length}"] = [
                rows[b][f"{who}_tok_s"] if b in rows else math.nan for b in batches]
    return line_chart_png(path, "decode throughput against batch size", batches, series,
                          xlabel="batch size", ylabel="output tokens/s", log_x=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--context-lens", default="128,1024")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-cell-tokens", type=int, default=None,
                        help="skip cells whose batch × context exceeds this")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each cell, engine and bare loop alternately")
    parser.add_argument("--png", type=Path, default=Path("results/scaling.png"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    batches = sorted(int(b) for b in args.batch_sizes.split(","))
    lengths = sorted(int(n) for n in args.context_lens.split(","))
    if args.repeats < 1:
        parser.error(f"--repeats: need at least 1, got {args.repeats}")
    records = run(args.model, cells(batches, lengths, args.max_cell_tokens), args.output_len,
                  args.repeats)
    print()
    for length in sorted({r["context"] for r in records}):
        rows = [r for r in records if r["context"] == length]
        k = growth_exponent([r["batch"] for r in rows], [r["overhead_step_ms"] for r in rows])
        shape = "at most linear" if k is not None and k <= 1.05 else "FASTER than linear"
        verdict = "-" if k is None else f"{k:.2f} ({shape})"
        print(f"context {length}: engine overhead per step grows as batch^{verdict}")
    print(f"chart: {chart(records, args.png)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()
