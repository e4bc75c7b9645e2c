"""Decode throughput at batch 1, 64 and 256, with and without CUDA graphs, in one run.

    python benchmarks/bench_decode.py [--model qwen3-1.7b] [--batch-sizes 1,64,256] \
        [--output-len 128] [--kv-cache-dtypes auto,fp8] [--json RESULT.json]

The default model is the Qwen3-1.7B config (vllm/benchmarks/assets.py) with dummy weights
and the demo tokenizer, bf16 on CUDA. Prompts are 8 tokens, so the time is decode time; each
batch runs once to warm up (Triton compiles, graphs capture at engine start) and once measured.
Needs CUDA unless --allow-cpu (then use a demo model, e.g. --model demo-tiny, to try it out).
--kv-cache-dtypes auto,fp8 adds a CUDA-graphs run per other --kv-cache-dtype and its tok/s
as a ratio to the full-precision cache's, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from vllm import LLM, SamplingParams
from vllm.benchmarks.sweep import PRESETS, prepare_model


def measure(llm: LLM, batch: int, output_len: int) -> float:
    """Generated tokens per second for `batch` requests of output_len tokens each."""
    prompts = [[100 + i, 200, 300, 400, 500, 600, 700, 800] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--allow-cpu", action="store_true")
    parser.add_argument("--kv-cache-dtypes", default="auto",
                        help="comma list; each other than auto adds a CUDA-graphs run")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("bench_decode: needs CUDA (pass --allow-cpu with a demo model to try it out)")
        return 0
    batches = [int(b) for b in args.batch_sizes.split(",")]
    preset = next((p for p in PRESETS.values() if p.model == args.model), None)
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as workdir:
        # A preset's model may be a bare config.json: prepare_model adds the demo tokenizer.
        model = prepare_model(preset, Path(workdir)).serve_arg if preset else args.model
        results: dict[str, dict[int, float]] = {}
        extra = [d for d in args.kv_cache_dtypes.split(",") if d != "auto"]
        runs = [(False, "auto"), (True, "auto")] + [(False, d) for d in extra]
        for eager, cache_dtype in runs:
            label = "eager" if eager else "cuda-graphs"
            if cache_dtype != "auto":
                label += f"/kv-{cache_dtype}"
            llm = LLM(model, load_format="dummy", enforce_eager=eager,
                      max_num_seqs=max(batches), max_model_len=1024,
                      kv_cache_dtype=cache_dtype)
            try:
                results[label] = {}
                for batch in batches:
                    results[label][batch] = measure(llm, batch, args.output_len)
                    print(f"{label:12s} batch {batch:4d}: {results[label][batch]:10.1f} tok/s",
                          flush=True)
                    if args.json:  # after every batch: a run stopped by a time limit keeps it
                        args.json.parent.mkdir(parents=True, exist_ok=True)
                        args.json.write_text(json.dumps(results, indent=2))
            finally:
                llm.shutdown()
    head = "".join(f"   kv-{d} tok/s   kv-{d}/auto" for d in extra)
    print(f"\nbatch   cuda-graphs tok/s   eager tok/s   graphs/eager{head}")
    for batch in batches:
        g, e = results["cuda-graphs"][batch], results["eager"][batch]
        row = f"{batch:5d}   {g:17.1f}   {e:11.1f}   {g / e:12.2f}"
        for d in extra:
            x = results[f"cuda-graphs/kv-{d}"][batch]
            row += f"   {x:{len(d) + 9}.1f}   {x / g:{len(d) + 8}.2f}"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
