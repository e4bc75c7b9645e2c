"""Grammar fast-forward: forward passes per output token and tokens/s at 100% JSON with
fast-forward off / exact / canonical, against 0% JSON (plain text), in one run.

    .venv/bin/python benchmarks/bench_fast_forward.py [--model demo] [--num-prompts 32] \
        [--repeats 3] [--scheduling async|sync|both] [--json RESULT.json]

The JSON workload is schema-heavy, as extraction schemas are: objects with long keys, enums,
booleans and small integers, so much of each output is keys and punctuation the grammar
forces. The plain workload is the same prompts unconstrained, each as long as the JSON
outputs are on average. Each round runs every cell once (interleaved, so a noisy machine
touches all alike); figures are medians over the rounds and ratios to plain are taken within
a round. Exact mode must give the outputs of off (checked). Forward passes are the engine's
steps: a step runs one forward pass for the whole batch, so steps per output token fall as
several tokens of a request enter one step.
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
        "document_category": {"enum": ["invoice", "receipt", "contract", "letter"]},
        "billing_currency_code": {"enum": ["EUR", "USD", "GBP"]},
        "is_paid_in_full": {"type": "boolean"},
        "processing_priority_level": {"type": "integer", "minimum": 0, "maximum": 9},
        "customer_display_name": {"type": "string", "maxLength": 12},
        "shipping_country_code": {"enum": ["DE", "FR", "US", "GB", "JP"]},
        "is_recurring_subscription": {"type": "boolean"},
        "number_of_line_items": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["document_category", "billing_currency_code", "is_paid_in_full",
                 "processing_priority_level", "customer_display_name",
                 "shipping_country_code", "is_recurring_subscription",
                 "number_of_line_items"],
    "additionalProperties": False,
}
MODES = ("off", "exact", "canonical")
MAX_TOKENS = 160


def run_cell(llm: LLM, prompts: list[str], structured: bool, plain_tokens: int
             ) -> tuple[float, float, int, list[list[int]]]:
    """Generated tokens per second, engine steps per generated token, forced tokens kept,
    and the outputs' tokens. Plain requests generate exactly `plain_tokens` tokens each."""
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    if structured:
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if i % 2 else 0.8,
                                 seed=i, structured_outputs=so)
                  for i in range(len(prompts))]
    else:
        params = [SamplingParams(max_tokens=plain_tokens, ignore_eos=True,
                                 temperature=0.0 if i % 2 else 0.8, seed=i)
                  for i in range(len(prompts))]
    scheduler = llm.llm_engine.engine_core.scheduler
    kept_before = scheduler.drafter.stats.num_forced_kept_tokens
    steps_before = scheduler._step_id
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    total = sum(map(len, tokens))
    steps = scheduler._step_id - steps_before
    kept = scheduler.drafter.stats.num_forced_kept_tokens - kept_before
    return total / elapsed, steps / max(total, 1), kept, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scheduling", choices=["async", "sync", "both"], default="both")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    prompts = [f"Document {i}: extract the fields as JSON." for i in range(args.num_prompts)]
    schedulings = {"async": [True], "sync": [False], "both": [False, True]}[args.scheduling]
    engines = {
        (a, mode): LLM(args.model, async_scheduling=a, max_num_seqs=args.num_prompts,
                       max_model_len=512, structured_outputs_config={"fast_forward": mode})
        for a in schedulings for mode in MODES
    }
    # Cells: (async, mode) at 100% JSON, and (async, "plain") on the off engine.
    cells = [(a, m) for a in schedulings for m in (*MODES, "plain")]
    # Warm up (compile the grammar, first forward passes); the plain length follows the
    # JSON outputs' mean length with fast-forward off.
    _, _, _, warm = run_cell(engines[(schedulings[0], "off")], prompts, True, 0)
    plain_tokens = round(statistics.mean(map(len, warm)))
    for (a, mode), llm in engines.items():
        run_cell(llm, prompts[:4], True, plain_tokens)
    rates: dict = {c: [] for c in cells}
    steps: dict = {c: [] for c in cells}
    ratios: dict = {c: [] for c in cells}
    kept: dict = {}
    counts: dict = {}
    for _ in range(args.repeats):
        outputs = {}
        for a, mode in cells:
            llm = engines[(a, "off" if mode == "plain" else mode)]
            rate, per_token, kept[(a, mode)], outputs[(a, mode)] = run_cell(
                llm, prompts, mode != "plain", plain_tokens)
            counts[(a, mode)] = sum(map(len, outputs[(a, mode)]))
            rates[(a, mode)].append(rate)
            steps[(a, mode)].append(per_token)
        for a in schedulings:
            assert outputs[(a, "exact")] == outputs[(a, "off")], "exact mode changed an output"
            for mode in (*MODES, "plain"):
                ratios[(a, mode)].append(rates[(a, mode)][-1] / rates[(a, "plain")][-1])
    for llm in engines.values():
        llm.shutdown()
    print(f"{args.num_prompts} requests; JSON outputs {plain_tokens} tokens each on average "
          f"(off), plain outputs {plain_tokens} tokens; {args.repeats} rounds (medians)")
    print("| scheduling | workload | fast-forward | forward passes / output token | tok/s "
          "| vs plain | tokens fast-forwarded |")
    print("|---|---|---|---|---|---|---|")
    result = {}
    for a in schedulings:
        name = "async" if a else "sync"
        for mode in ("plain", *MODES):
            cell = (a, mode)
            workload = "0% JSON" if mode == "plain" else "100% JSON"
            ff = "-" if mode == "plain" else mode
            rate = statistics.median(rates[cell])
            per_token = statistics.median(steps[cell])
            ratio = statistics.median(ratios[cell])
            share = kept[cell] / max(counts[cell], 1)
            print(f"| {name} | {workload} | {ff} | {per_token:.3f} | {rate:.0f} | "
                  f"{ratio:.2f}x | {share:.0%} |")
            result[f"{name}/{mode}"] = {"passes_per_token": per_token, "tok_s": rate,
                                        "vs_plain": ratio, "fast_forwarded_share": share}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
