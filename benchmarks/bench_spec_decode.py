"""Speculative decoding (n-gram drafts): tokens/s with and without drafts, one run.

    .venv/bin/python benchmarks/bench_spec_decode.py [--model demo] [--num-prompts 32] \
        [--output-len 128] [--num-speculative-tokens 3] [--workloads stories,repetitive]

Cells: {workload} x {0 %, 100 % JSON-schema requests} x {sync, async} x {no drafts, drafts},
all on the uni executor, greedy with ignore_eos so every cell generates the same number of
tokens. `stories` are bench_offline's prompts; `repetitive` prompts repeat a record several
times, the text where prompt lookup pays. Prints tokens/s, drafts/no-drafts, the draft
acceptance rate and the mean accepted length (1 + kept drafts per verification).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench_offline import SCHEMA, make_prompts

from vllm import LLM, SamplingParams, StructuredOutputsParams


def repetitive_prompts(n: int) -> list[str]:
    """Prompts that repeat one record a few times, then start it again."""
    out = []
    for i in range(n):
        record = f'{{"id": {i}, "title": "item {i % 7}", "score": {i % 10}}}\n'
        out.append("Copy the records:\n" + record * (3 + i % 3) + record[: 10 + i % 5])
    return out


def run(model: str, async_scheduling: bool, prompts: list[str], output_len: int,
        structured: bool, num_spec: int) -> dict[str, float]:
    spec = ({"method": "ngram", "num_speculative_tokens": num_spec, "prompt_lookup_max": 4}
            if num_spec else None)
    llm = LLM(model, async_scheduling=async_scheduling, max_num_seqs=max(len(prompts), 1),
              speculative_config=spec)
    try:
        constraint = (
            StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if structured else None
        )
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                                structured_outputs=constraint)
        llm.generate(prompts[:4], params, use_tqdm=False)  # warm up (grammar compile, kernels)
        scheduler = llm.llm_engine.engine_core.scheduler
        before = (scheduler.num_spec_steps, scheduler.num_draft_tokens,
                  scheduler.num_accepted_tokens)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        steps, drafted, accepted = (
            now - then for now, then in zip(
                (scheduler.num_spec_steps, scheduler.num_draft_tokens,
                 scheduler.num_accepted_tokens), before)
        )
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {
            "tokens": tokens,
            "seconds": elapsed,
            "tok_per_s": tokens / elapsed,
            "draft_tokens": drafted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / steps if steps else 1.0,
        }
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--workloads", default="stories,repetitive")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    workloads = {"stories": make_prompts, "repetitive": repetitive_prompts}
    results: dict[str, dict[str, float]] = {}
    print(f"{'cell':34s} {'tok/s':>8s} {'drafts/none':>11s} {'accept':>7s} {'mean len':>8s}")
    for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        prompts = workloads[name](args.num_prompts)
        for share in ("0%", "100%"):
            for mode in ("sync", "async"):
                base = None
                for num_spec in (0, args.num_speculative_tokens):
                    key = f"{name}/{share}/{mode}/{'k=' + str(num_spec) if num_spec else 'none'}"
                    r = results[key] = run(args.model, mode == "async", prompts,
                                           args.output_len, share == "100%", num_spec)
                    base = base or r["tok_per_s"]
                    print(f"{key:34s} {r['tok_per_s']:8.1f} {r['tok_per_s'] / base:11.2f} "
                          f"{r['acceptance_rate']:7.2f} {r['mean_accepted_length']:8.2f}",
                          flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
