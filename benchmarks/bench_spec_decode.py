"""Speculative decoding: tokens/s with and without drafts, one run.

    .venv/bin/python benchmarks/bench_spec_decode.py [--model demo] [--num-prompts 32] \
        [--output-len 64] [--num-speculative-tokens 3] [--repeats 3] \
        [--draft-model demo-tiny] [--method eagle3 --head DIR] \
        [--workloads stories,repetitive] [--json results/bench_spec_decode.json]

Drafts come from n-gram prompt lookup, with `--draft-model` from that model, or with
`--method eagle3 --head DIR` from that EAGLE-3 head (benchmarks/train_eagle3.py trains one).

For sync and async scheduling (uni executor) one engine is started with speculative
decoding; every cell, {workload} x {0 %, 100 % JSON-schema requests}, then runs with drafts
off and on in turn, `--repeats` times interleaved (these machines are noisy: back-to-back runs
in one process are the fairest comparison). Drafts off means the scheduler's proposer is
switched off, which is exactly an engine started without `--speculative-config` (with
EAGLE-3 the runner's head and the target's copies of its hidden states are switched off
too).
Requests are greedy with ignore_eos, so every run generates the same number of tokens.
`stories` are bench_offline's prompts; `repetitive` prompts repeat a record several times,
the text where prompt lookup pays. Prints median tokens/s with the min-max range, the ratio
of medians, the draft acceptance rate, the mean accepted length (1 + kept drafts per
verification), the acceptance per position (the share of verifications that kept draft j,
and so every draft before it) and the forward passes of the first run without and with drafts (greedy:
the same in every run; on a CPU a verified row costs what a decoded one does, on a GPU a
forward costs about the same whatever its rows, so the forwards say what drafts save there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench_offline import make_prompts, structured_schema

from vllm import LLM, SamplingParams, StructuredOutputsParams


def repetitive_prompts(n: int) -> list[str]:
    """Prompts that repeat one record a few times, then start it again."""
    out = []
    for i in range(n):
        record = f'{{"id": {i}, "title": "item {i % 7}", "score": {i % 10}}}\n'
        out.append("Copy the records:\n" + record * (3 + i % 3) + record[: 10 + i % 5])
    return out


WORKLOADS = {"stories": make_prompts, "repetitive": repetitive_prompts}


def timed(llm: LLM, prompts: list[str], params: SamplingParams, drafts: bool,
          proposer) -> dict[str, float]:
    """One generate call with the scheduler's proposer on or off; its tokens/s and drafts."""
    scheduler = llm.llm_engine.engine_core.scheduler
    scheduler.drafter.proposer = proposer if drafts else None
    switch_head(llm, drafts)
    spec = scheduler.drafter.stats
    before = (spec.num_steps, spec.num_draft_tokens, spec.num_accepted_tokens)
    per_pos_before = list(spec.num_accepted_tokens_per_pos)
    # Forward passes, counted as the steps scheduled with tokens: a noise-free measure of
    # what drafts save where a forward costs the same whatever its rows (a GPU).
    forwards = 0
    schedule = scheduler.schedule

    def counting_schedule():
        nonlocal forwards
        output = schedule()
        forwards += output.total_num_scheduled_tokens > 0
        return output

    scheduler.schedule = counting_schedule
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        del scheduler.schedule  # back to the class's method
    steps, drafted, accepted = (
        now - then for now, then in zip(
            (spec.num_steps, spec.num_draft_tokens, spec.num_accepted_tokens), before)
    )
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # Verifications that kept draft j (and every one before it), by position j.
    per_pos = [now - (per_pos_before[j] if j < len(per_pos_before) else 0)
               for j, now in enumerate(spec.num_accepted_tokens_per_pos)]
    return {"tok_per_s": tokens / elapsed, "steps": steps, "drafted": drafted,
            "accepted": accepted, "accepted_per_pos": per_pos, "forwards": forwards}


# The runner's EAGLE-3 drafter and the target's auxiliary-layer slots, by engine, while off.
_HEADS: dict[int, tuple] = {}


def switch_head(llm: LLM, on: bool) -> None:
    """Turns an in-process engine's EAGLE-3 head (the runner's drafting and the target's
    copies of its hidden states) on or off; nothing for other methods."""
    runner = llm.llm_engine.engine_core.model_executor.worker.model_runner
    aux = runner.model.model
    if not on and runner.eagle3 is not None:
        _HEADS[id(llm)] = (runner.eagle3, aux._aux_slots)
        runner.eagle3, aux._aux_slots = None, {}
    elif on and id(llm) in _HEADS:
        runner.eagle3, aux._aux_slots = _HEADS.pop(id(llm))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft-model", default=None,
                        help="draft with this model (same vocabulary) instead of n-gram lookup")
    parser.add_argument("--method", default=None, choices=("ngram", "draft_model", "eagle3"),
                        help="default: draft_model with --draft-model, else ngram")
    parser.add_argument("--head", default=None, help="--method eagle3: the head's directory")
    parser.add_argument("--workloads", default="stories,repetitive")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": 4}
    method = args.method or ("draft_model" if args.draft_model else "ngram")
    if method == "draft_model":
        if not args.draft_model:
            parser.error("--method draft_model needs --draft-model")
        spec = {"method": "draft_model", "model": args.draft_model,
                "num_speculative_tokens": args.num_speculative_tokens}
    elif method == "eagle3":
        if not args.head:
            parser.error("--method eagle3 needs --head DIR (benchmarks/train_eagle3.py)")
        spec = {"method": "eagle3", "model": args.head,
                "num_speculative_tokens": args.num_speculative_tokens}
    results: dict[str, dict] = {}
    print(f"{'cell':26s} {'none tok/s (range)':>22s} {'drafts tok/s (range)':>22s} "
          f"{'ratio':>6s} {'accept':>7s} {'mean len':>8s} {'forwards':>11s}  per position",
          flush=True)
    for mode in ("sync", "async"):
        llm = LLM(args.model, async_scheduling=mode == "async",
                  max_num_seqs=max(args.num_prompts, 1), speculative_config=spec)
        proposer = llm.llm_engine.engine_core.scheduler.drafter.proposer
        try:
            for name in workloads:
                prompts = WORKLOADS[name](args.num_prompts)
                for share in ("0%", "100%"):
                    constraint = (StructuredOutputsParams(json=structured_schema(args.output_len),
                                                          disable_any_whitespace=True)
                                  if share == "100%" else None)
                    params = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                            ignore_eos=True, structured_outputs=constraint)
                    timed(llm, prompts[:4], params, True, proposer)  # warm up, compile
                    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
                    for _ in range(args.repeats):
                        for drafts in (False, True):
                            runs[drafts].append(timed(llm, prompts, params, drafts, proposer))
                    key = f"{name}/{share}/{mode}"
                    none = [r["tok_per_s"] for r in runs[False]]
                    with_drafts = [r["tok_per_s"] for r in runs[True]]
                    steps = sum(r["steps"] for r in runs[True])
                    drafted = sum(r["drafted"] for r in runs[True])
                    accepted = sum(r["accepted"] for r in runs[True])
                    width = max(len(r["accepted_per_pos"]) for r in runs[True])
                    per_pos = [sum(r["accepted_per_pos"][j] for r in runs[True]
                                   if j < len(r["accepted_per_pos"])) for j in range(width)]
                    cell = results[key] = {
                        "none_tok_per_s": none,
                        "drafts_tok_per_s": with_drafts,
                        "ratio_of_medians": statistics.median(with_drafts)
                        / statistics.median(none),
                        "acceptance_rate": accepted / drafted if drafted else 0.0,
                        "mean_accepted_length": 1 + accepted / steps if steps else 1.0,
                        "acceptance_per_position": [n / steps for n in per_pos] if steps else [],
                        "forwards_none": runs[False][0]["forwards"],
                        "forwards_drafts": runs[True][0]["forwards"],
                    }
                    forwards = f"{cell['forwards_none']}/{cell['forwards_drafts']}"
                    print(f"{key:26s} {_cell(none):>22s} {_cell(with_drafts):>22s} "
                          f"{cell['ratio_of_medians']:6.2f} {cell['acceptance_rate']:7.2f} "
                          f"{cell['mean_accepted_length']:8.2f} {forwards:>11s}  "
                          + "/".join(f"{a:.2f}" for a in cell["acceptance_per_position"]),
                          flush=True)
        finally:
            llm.shutdown()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.0f}-{max(values):.0f})"


if __name__ == "__main__":
    main()
