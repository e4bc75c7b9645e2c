"""Offline throughput: {sync, async} x {uni, mp} x {0 %, 100 % JSON-schema requests}, one run.

    .venv/bin/python benchmarks/bench_offline.py [--model demo] [--num-prompts 64] \
        [--output-len 128] [--json results/bench_offline.json]

Plain requests are greedy with ignore_eos; structured ones follow a JSON schema whose string
field lets a random model write all output_len tokens, so every configuration generates the
same number of tokens. Also reports the median grammar-bitmask fill time per request per step
(measured in the engine process, where the scheduler fills it). Prints tokens/s and the ratios
that matter: async/sync, and 100 % / 0 % structured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from vllm import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "score": {"type": "integer"}},
    "required": ["title", "score"],
}


def make_prompts(n: int) -> list[str]:
    topics = ["the ocean", "a village", "quantum computers", "tea", "a robot", "jazz", "bees"]
    return [f"Request {i}: a story about {topics[i % len(topics)]}" + " please" * (i % 4)
            for i in range(n)]


def run(model: str, async_scheduling: bool, backend: str, prompts: list[str], output_len: int,
        structured: bool) -> dict[str, float]:
    llm = LLM(model, async_scheduling=async_scheduling, distributed_executor_backend=backend,
              max_num_seqs=max(len(prompts), 1))
    try:
        constraint = (
            StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if structured else None
        )
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                                structured_outputs=constraint)
        manager = llm.llm_engine.engine_core.structured_output_manager
        fill_us: list[float] = []
        fill = manager.grammar_bitmask

        def timed_fill(requests, req_ids):
            t = time.perf_counter()
            out = fill(requests, req_ids)
            fill_us.append((time.perf_counter() - t) * 1e6 / max(len(req_ids), 1))
            return out

        manager.grammar_bitmask = timed_fill
        llm.generate(prompts[:4], params, use_tqdm=False)  # warm up (grammar compile, kernels)
        fill_us.clear()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {
            "tokens": tokens,
            "seconds": elapsed,
            "tok_per_s": tokens / elapsed,
            "fill_us_per_request_median": statistics.median(fill_us) if fill_us else 0.0,
        }
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    prompts = make_prompts(args.num_prompts)
    results: dict[str, dict[str, float]] = {}
    for backend in ("uni", "mp"):
        for async_scheduling in (False, True):
            for structured in (False, True):
                key = f"{'async' if async_scheduling else 'sync'}/{backend}/" \
                      f"{'100%' if structured else '0%'}"
                results[key] = run(args.model, async_scheduling, backend, prompts,
                                   args.output_len, structured)
                r = results[key]
                print(f"{key:18s} {r['tok_per_s']:8.1f} tok/s  ({r['tokens']} tokens in "
                      f"{r['seconds']:.1f} s; fill {r['fill_us_per_request_median']:.1f} us/req)",
                      flush=True)
    print("\nconfig         0% tok/s   100% tok/s   100%/0%")
    for mode in ("sync", "async"):
        for backend in ("uni", "mp"):
            plain = results[f"{mode}/{backend}/0%"]["tok_per_s"]
            structured = results[f"{mode}/{backend}/100%"]["tok_per_s"]
            ratio = structured / plain
            print(f"{mode}/{backend:4s}   {plain:10.1f}   {structured:10.1f}   {ratio:7.2f}")
    for backend in ("uni", "mp"):
        for share in ("0%", "100%"):
            ratio = results[f"async/{backend}/{share}"]["tok_per_s"] / results[
                f"sync/{backend}/{share}"]["tok_per_s"]
            print(f"async/sync {backend} {share}: {ratio:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
