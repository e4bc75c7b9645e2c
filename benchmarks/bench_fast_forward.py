"""Grammar fast-forward: JSON tokens/s with and without it, sync and async, in one run.

    .venv/bin/python benchmarks/bench_fast_forward.py [--model demo] [--num-prompts 32] \
        [--repeats 3] [--json RESULT.json]

Every request follows a schema of short, bounded fields (enums, booleans, small integers,
short strings), as extraction schemas are: much of each output is keys and punctuation the
grammar forces. Each round runs every cell once (interleaved, so a noisy machine touches all
alike); figures are medians over the rounds and ratios are taken within a round. Outputs with
and without fast-forward must be identical (checked), since forced tokens are verified like
drafts. Also prints the share of tokens that came fast-forwarded (each saves a step).
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
    "properties": {
        "category": {"enum": ["invoice", "receipt", "contract", "letter"]},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "paid": {"type": "boolean"},
        "priority": {"type": "integer", "minimum": 0, "maximum": 9},
        "customer_name": {"type": "string", "maxLength": 12},
        "country_code": {"enum": ["DE", "FR", "US", "GB", "JP"]},
        "is_recurring": {"type": "boolean"},
        "line_item_count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["category", "currency", "paid", "priority", "customer_name", "country_code",
                 "is_recurring", "line_item_count"],
    "additionalProperties": False,
}


def run_cell(llm: LLM, prompts: list[str]) -> tuple[float, int, list[list[int]]]:
    """Generated tokens per second, tokens fast-forwarded (kept without a forward pass of
    their own), and the outputs' tokens."""
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(max_tokens=96, temperature=0.0 if i % 2 else 0.8, seed=i,
                             structured_outputs=so) for i in range(len(prompts))]
    scheduler = llm.llm_engine.engine_core.scheduler
    spec = scheduler.drafter.stats
    kept_before = spec.num_accepted_tokens
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / elapsed, spec.num_accepted_tokens - kept_before, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    prompts = [f"Document {i}: extract the fields as JSON." for i in range(args.num_prompts)]
    cells = [(a, ff) for a in (False, True) for ff in (False, True)]
    engines = {
        (a, ff): LLM(args.model, async_scheduling=a, max_num_seqs=args.num_prompts,
                     structured_outputs_config={"fast_forward": ff})
        for a, ff in cells
    }
    for llm in engines.values():  # warm up: compile the grammar, first forward passes
        run_cell(llm, prompts[:4])
    rates: dict[tuple[bool, bool], list[float]] = {c: [] for c in cells}
    ratios: dict[bool, list[float]] = {False: [], True: []}
    kept: dict[tuple[bool, bool], int] = {}
    for _ in range(args.repeats):
        outputs = {}
        for cell in cells:
            rate, kept[cell], outputs[cell] = run_cell(engines[cell], prompts)
            rates[cell].append(rate)
        for a in (False, True):
            assert outputs[(a, True)] == outputs[(a, False)], "fast-forward changed an output"
            ratios[a].append(rates[(a, True)][-1] / rates[(a, False)][-1])
    for llm in engines.values():
        llm.shutdown()
    mean_tokens = statistics.mean(len(t) for t in outputs[(False, False)])
    print(f"{args.num_prompts} JSON requests, {mean_tokens:.1f} tokens each, "
          f"{args.repeats} rounds (median tok/s)")
    total = sum(len(t) for t in outputs[(False, False)])
    print("| scheduling | fast-forward off | on | on / off | tokens fast-forwarded |")
    print("|---|---|---|---|---|")
    result = {}
    for a in (False, True):
        off, on = statistics.median(rates[(a, False)]), statistics.median(rates[(a, True)])
        ratio = statistics.median(ratios[a])
        name = "async" if a else "sync"
        share = kept[(a, True)] / max(total, 1)
        print(f"| {name} | {off:.0f} | {on:.0f} | {ratio:.2f}x | {share:.0%} |")
        result[name] = {"off_tok_s": off, "on_tok_s": on, "ratio": ratio,
                        "fast_forwarded_share": share}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
