"""Offline throughput: {sync, async} x {uni, mp} x {0 %, 100 % JSON-schema requests}.

    .venv/bin/python benchmarks/bench_offline.py [--model demo] [--num-prompts 64] \
        [--output-len 128] [--json results/bench_offline.json] [--repeats 3] \
        [--structured-outputs-backends xgrammar,guidance] [--configs async/uni,sync/uni]

Every cell runs once per round, rounds in a row (interleaved, so slow drifts of a shared
machine touch every cell alike); figures are the median (min-max) over the rounds, and each
ratio is taken between cells of the same round.

With several structured-output backends, each configuration runs its 100 % cell once per
backend (the 0 % cell does not depend on it), and the table gains a row per backend.

The ceiling: a bare greedy decode loop over the same checkpoint and prompts
(vllm/model_executor/greedy_decode_loop.py: no scheduler, paging, sampler or detokenizer) runs last in
every round, and every cell is also printed as a fraction of it (engine / bare;
`--no-ceiling` skips it).

Plain requests are greedy with ignore_eos; structured ones follow a JSON schema whose string
field must hold at least CHARS_PER_TOKEN x output_len characters (`structured_schema`), so
even the demo models, whose weights are tilted toward closing JSON, write all output_len tokens
and every configuration generates the same number of tokens. A cell that generates fewer is
flagged where it prints and in the summary, and the script exits with status 1: its tok/s
would not be comparable. Also reports the median grammar-bitmask fill time per request per step
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

# Characters the structured requests' string must hold per output token. The tilted demo
# models write 1-3 character closing tokens inside a string (their quote is masked until the
# minimum is reached); 8 leaves room for longer tokens of other models, and the shortfall
# check below catches a model that still closes early.
CHARS_PER_TOKEN = 8


def structured_schema(output_len: int) -> dict:
    """A JSON schema no response can satisfy in fewer than output_len tokens of up to
    CHARS_PER_TOKEN characters each: one string with that minimum length, then an integer."""
    return {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": CHARS_PER_TOKEN * output_len},
            "score": {"type": "integer"},
        },
        "required": ["title", "score"],
    }


def shortfall(tokens: int, num_prompts: int, output_len: int) -> str | None:
    """A warning when a cell generated fewer than num_prompts x output_len tokens (its tok/s
    then measures a smaller workload than the other cells), else None."""
    expected = num_prompts * output_len
    if tokens >= expected:
        return None
    return (f"generated {tokens} of {expected} tokens: its requests stopped early, so its "
            "tok/s is not comparable with the other cells")


def make_prompts(n: int) -> list[str]:
    topics = ["the ocean", "a village", "quantum computers", "tea", "a robot", "jazz", "bees"]
    return [f"Request {i}: a story about {topics[i % len(topics)]}" + " please" * (i % 4)
            for i in range(n)]


def run(model: str, async_scheduling: bool, backend: str, prompts: list[str], output_len: int,
        structured: bool, grammar_backend: str = "auto") -> dict[str, float]:
    llm = LLM(model, async_scheduling=async_scheduling, distributed_executor_backend=backend,
              max_num_seqs=max(len(prompts), 1),
              structured_outputs_config={"backend": grammar_backend})
    try:
        constraint = (
            StructuredOutputsParams(json=structured_schema(output_len), disable_any_whitespace=True)
            if structured else None
        )
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                                structured_outputs=constraint)
        manager = llm.llm_engine.engine_core.structured_output_manager
        fill_us: list[float] = []
        fill = manager.grammar_bitmask

        def timed_fill(requests, req_ids, *rest):
            t = time.perf_counter()
            out = fill(requests, req_ids, *rest)
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


def ceiling(model: str, prompts: list[str], output_len: int) -> dict[str, float]:
    """Tokens/s of the bare decode loop on the same checkpoint, prompts and output length."""
    import torch

    from vllm.model_executor.greedy_decode_loop import BareDecoder
    from vllm.transformers_utils.hub import resolve_model_path
    from vllm.transformers_utils.tokenizer import get_tokenizer

    model_dir = resolve_model_path(model)
    tokenizer = get_tokenizer(model_dir)
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    cuda = torch.cuda.is_available()
    decoder = BareDecoder(model_dir, dtype=torch.bfloat16 if cuda else torch.float32,
                          device="cuda" if cuda else "cpu")
    decoder.generate(ids[:4], output_len)  # warm up
    start = time.perf_counter()
    outs = decoder.generate(ids, output_len)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o) for o in outs)
    return {"tokens": tokens, "seconds": elapsed, "tok_per_s": tokens / elapsed}


def spread(values: list[float], digits: int = 2) -> str:
    """`median (min-max)` of a cell's repeats."""
    median, low, high = statistics.median(values), min(values), max(values)
    return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def paired_ratios(num: list[float], den: list[float]) -> list[float]:
    """Round-by-round ratios: two cells of one round ran minutes apart at most, so their ratio
    is steadier on a noisy machine than a ratio of medians over all rounds."""
    return [a / b for a, b in zip(num, den, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--structured-outputs-backends", default="auto",
                        help="comma-separated: auto, xgrammar, guidance")
    parser.add_argument("--configs", default="sync/uni,async/uni,sync/mp,async/mp",
                        help="comma-separated scheduling/executor pairs")
    parser.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the bare decode loop and print engine / bare ratios")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds; each runs every cell once (interleaved), and every "
                             "figure is the median (min-max) over the rounds")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    prompts = make_prompts(args.num_prompts)
    grammar_backends = [b.strip() for b in args.structured_outputs_backends.split(",") if b]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    cells = [(config, None) for config in configs]
    cells += [(config, b) for config in configs for b in grammar_backends]
    cells.sort(key=lambda c: configs.index(c[0]))
    keys = [f"{c}/0%" if b is None else f"{c}/100%/{b}" for c, b in cells]
    runs: dict[str, list[dict[str, float]]] = {key: [] for key in keys}
    if args.ceiling:
        runs["bare"] = []
    short: dict[str, str] = {}
    for round_ in range(1, args.repeats + 1):
        for key, (config, grammar_backend) in zip(keys, cells):
            mode, backend = config.split("/")
            r = run(args.model, mode == "async", backend, prompts, args.output_len,
                    grammar_backend is not None, grammar_backend or "auto")
            runs[key].append(r)
            print(f"[round {round_}] {key:28s} {r['tok_per_s']:8.1f} tok/s  ({r['tokens']} "
                  f"tokens in {r['seconds']:.1f} s; fill {r['fill_us_per_request_median']:.1f} "
                  "us/req)", flush=True)
            warning = shortfall(int(r["tokens"]), len(prompts), args.output_len)
            if warning is not None:
                short[key] = warning
                print(f"[round {round_}] !! {key}: {warning}", flush=True)
        if args.ceiling:
            bare = ceiling(args.model, prompts, args.output_len)
            runs["bare"].append(bare)
            print(f"[round {round_}] {'bare decode loop':28s} {bare['tok_per_s']:8.1f} tok/s",
                  flush=True)
    tok = {key: [r["tok_per_s"] for r in rs] for key, rs in runs.items()}
    print(f"\n{args.repeats} round(s); tok/s and ratios are median (min-max) over rounds, "
          "ratios taken within each round")
    print(f"\n{'config':12s} {'backend':9s} {'0% tok/s':>24s} {'100% tok/s':>24s} "
          f"{'100%/0%':>20s}")
    for config in configs:
        plain = tok[f"{config}/0%"]
        for b in grammar_backends:
            structured = tok[f"{config}/100%/{b}"]
            print(f"{config:12s} {b:9s} {spread(plain, 1):>24s} {spread(structured, 1):>24s} "
                  f"{spread(paired_ratios(structured, plain)):>20s}")
    for executor in ("uni", "mp"):
        if f"sync/{executor}" not in configs or f"async/{executor}" not in configs:
            continue
        for share in ["0%"] + [f"100%/{b}" for b in grammar_backends]:
            ratios = paired_ratios(
                tok[f"async/{executor}/{share}"], tok[f"sync/{executor}/{share}"]
            )
            print(f"async/sync {executor} {share}: {spread(ratios)}")
    if args.ceiling:
        print(f"\nbare decode loop: {spread(tok['bare'], 1)} tok/s")
        for key in keys:
            print(f"engine/bare {key:28s} {spread(paired_ratios(tok[key], tok['bare']))}")
    if args.json:
        summary = {
            key: {"tok_per_s": statistics.median(tok[key]), "runs": rs}
            for key, rs in runs.items()
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
    if short:
        for key, warning in short.items():
            print(f"!! {key}: {warning}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
