"""Grammar fast-forward: forward passes per output token and tokens/s at 100% JSON with
fast-forward off / exact / canonical, against 0% JSON (plain text), in one run.

    .venv/bin/python benchmarks/bench_fast_forward.py [--model demo] [--num-prompts 32] \
        [--repeats 3] [--scheduling async|sync|both] [--workloads schema-heavy,sweep] \
        [--json RESULT.json]

Two JSON workloads: `schema-heavy`, as extraction schemas are (objects with long keys,
enums, booleans and small integers, so much of each output is keys and punctuation the
grammar forces), and `sweep`, the JSON schemas structured_sweep.py serves (the shipped
`structured_schema_*`, one per request in turn). Each has its own plain workload: the same
prompts unconstrained, each as long as its JSON outputs are on average with fast-forward
off. Each round runs every cell once (interleaved, so a noisy machine
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
from vllm.benchmarks.assets import SCHEMA_NAMES, builtin_schema

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
# A second schema-heavy shape: nested objects, long keys, enums and booleans.
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "shipment_tracking_status": {"enum": ["label_created", "in_transit", "delivered"]},
        "recipient_contact_details": {
            "type": "object",
            "properties": {
                "preferred_contact_channel": {"enum": ["email", "phone", "post"]},
                "has_opted_into_notifications": {"type": "boolean"},
            },
            "required": ["preferred_contact_channel", "has_opted_into_notifications"],
            "additionalProperties": False,
        },
        "package_weight_category": {"enum": ["light", "medium", "heavy"]},
        "requires_signature_on_delivery": {"type": "boolean"},
    },
    "required": ["shipment_tracking_status", "recipient_contact_details",
                 "package_weight_category", "requires_signature_on_delivery"],
    "additionalProperties": False,
}
WORKLOADS = {
    "schema-heavy": [SCHEMA, NESTED_SCHEMA],
    "sweep": [builtin_schema(name) for name in SCHEMA_NAMES],
}
MODES = ("off", "exact", "canonical")
MAX_TOKENS = 160


def run_cell(llm: LLM, prompts: list[str], schemas: list[dict] | None, plain_tokens: int
             ) -> tuple[float, float, int, list[list[int]]]:
    """Generated tokens per second, engine steps per generated token, forced tokens kept,
    and the outputs' tokens. Request i follows schemas[i % len(schemas)]; with `schemas`
    None the requests are plain and generate exactly `plain_tokens` tokens each."""
    if schemas is not None:
        params = [SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0 if i % 2 else 0.8, seed=i,
            structured_outputs=StructuredOutputsParams(
                json=schemas[i % len(schemas)], disable_any_whitespace=True))
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
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        parser.error(f"--workloads: unknown {unknown}; known: {', '.join(WORKLOADS)}")
    prompts = [f"Document {i}: extract the fields as JSON." for i in range(args.num_prompts)]
    schedulings = {"async": [True], "sync": [False], "both": [False, True]}[args.scheduling]
    engines = {
        (a, mode): LLM(args.model, async_scheduling=a, max_num_seqs=args.num_prompts,
                       max_model_len=512, structured_outputs_config={"fast_forward": mode})
        for a in schedulings for mode in MODES
    }
    # Cells: (workload, async, mode) at 100% JSON, and "plain" (0%) on the off engine.
    cells = [(w, a, m) for w in workloads for a in schedulings for m in (*MODES, "plain")]
    # Warm up (compile the grammars, first forward passes); each workload's plain length
    # follows its JSON outputs' mean length with fast-forward off.
    plain_tokens = {}
    for w in workloads:
        _, _, _, warm = run_cell(engines[(schedulings[0], "off")], prompts, WORKLOADS[w], 0)
        plain_tokens[w] = round(statistics.mean(map(len, warm)))
        for llm in engines.values():
            run_cell(llm, prompts[:4], WORKLOADS[w], plain_tokens[w])
    rates: dict = {c: [] for c in cells}
    steps: dict = {c: [] for c in cells}
    ratios: dict = {c: [] for c in cells}
    kept: dict = {}
    counts: dict = {}
    for _ in range(args.repeats):
        outputs = {}
        for w, a, mode in cells:
            llm = engines[(a, "off" if mode == "plain" else mode)]
            schemas = None if mode == "plain" else WORKLOADS[w]
            cell = (w, a, mode)
            rate, per_token, kept[cell], outputs[cell] = run_cell(
                llm, prompts, schemas, plain_tokens[w])
            counts[cell] = sum(map(len, outputs[cell]))
            rates[cell].append(rate)
            steps[cell].append(per_token)
        for w in workloads:
            for a in schedulings:
                assert outputs[(w, a, "exact")] == outputs[(w, a, "off")], (
                    f"{w}: exact mode changed an output")
                for mode in (*MODES, "plain"):
                    ratios[(w, a, mode)].append(
                        rates[(w, a, mode)][-1] / rates[(w, a, "plain")][-1])
    for llm in engines.values():
        llm.shutdown()
    print(f"{args.num_prompts} requests per cell, {args.repeats} rounds (medians); plain "
          "outputs as long as the workload's JSON outputs with fast-forward off: "
          + ", ".join(f"{w} {plain_tokens[w]} tokens" for w in workloads))
    print("| workload | scheduling | JSON | fast-forward | forward passes / output token "
          "| tok/s | vs plain | tokens fast-forwarded |")
    print("|---|---|---|---|---|---|---|---|")
    result = {}
    for w in workloads:
        for a in schedulings:
            name = "async" if a else "sync"
            for mode in ("plain", *MODES):
                cell = (w, a, mode)
                share = kept[cell] / max(counts[cell], 1)
                rate = statistics.median(rates[cell])
                per_token = statistics.median(steps[cell])
                ratio = statistics.median(ratios[cell])
                json_share = "0%" if mode == "plain" else "100%"
                ff = "-" if mode == "plain" else mode
                print(f"| {w} | {name} | {json_share} | {ff} | {per_token:.3f} | {rate:.0f} "
                      f"| {ratio:.2f}x | {share:.0%} |")
                result[f"{w}/{name}/{mode}"] = {
                    "passes_per_token": per_token, "tok_s": rate, "vs_plain": ratio,
                    "fast_forwarded_share": share}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
