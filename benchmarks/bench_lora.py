"""LoRA adapters: tokens/s of one batch with 0, 1 and 4 distinct adapters, at rank 8 and 64,
relative to the base model alone, one run.

    .venv/bin/python benchmarks/bench_lora.py [--model demo] [--num-prompts 16] \
        [--output-len 32] [--ranks 8,64] [--repeats 3]

Random PEFT adapters on every projection (q/k/v/o, gate/up/down) are written with `peft` into
a temporary directory. For each rank one engine is started
with `--max-lora-rank` equal to it and `--max-loras 4` (slots are as wide as the engine's
maximum rank, so a rank-8 adapter in a rank-64 engine would cost rank 64). Each cell runs the
same greedy batch (ignore_eos, so every run makes the same tokens), the cells interleaved
`--repeats` times (these machines are noisy: back-to-back runs in one process are the fairest
comparison). The LoRA kernel is whatever VLLM_LORA_BACKEND names (torch by default).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from vllm.model_executor.model_loader.demo_model import build_demo_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = (0, 1, 4)


def write_adapters(model_dir: Path, out: Path, rank: int, count: int) -> list[Path]:
    """Saves `count` random PEFT adapters of `rank` for the model in `model_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                            lora_dropout=0.0, task_type="CAUSAL_LM")
        model = get_peft_model(base, config)
        gen = torch.Generator().manual_seed(1000 * rank + i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:  # PEFT starts B at zero: a no-op adapter
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        path = out / f"r{rank}-{i}"
        model.save_pretrained(str(path))
        paths.append(path)
    return paths


def prompts(n: int) -> list[str]:
    """Distinct short prompts."""
    return [f"Request {i}: summarise the ticket about order {1000 + i}." for i in range(n)]


def timed(llm: LLM, batch: list[str], params: SamplingParams,
          loras: list[LoRARequest | None]) -> float:
    """Tokens/s of one generate call over `batch` with one adapter (or None) per prompt."""
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def assign(adapters: list[LoRARequest], distinct: int, n: int) -> list[LoRARequest | None]:
    """One adapter per prompt, cycling through the first `distinct` (none with 0)."""
    return [adapters[i % distinct] if distinct else None for i in range(n)]


def run_rank(model: str, rank: int, paths: list[Path], args: argparse.Namespace,
             ) -> dict[int, list[float]]:
    """Tokens/s per cell (number of distinct adapters) for one engine of `rank`."""
    llm = LLM(model, enable_lora=True, max_loras=max(ADAPTERS), max_lora_rank=rank,
              max_cpu_loras=max(ADAPTERS), max_num_seqs=max(args.num_prompts, 1))
    adapters = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(paths)]
    batch = prompts(args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    try:
        for distinct in ADAPTERS:  # warm up: load every adapter once
            timed(llm, batch[:4], params, assign(adapters, distinct, min(4, len(batch))))
        runs: dict[int, list[float]] = {d: [] for d in ADAPTERS}
        for _ in range(args.repeats):
            for distinct in ADAPTERS:
                runs[distinct].append(
                    timed(llm, batch, params, assign(adapters, distinct, len(batch))))
        return runs
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--ranks", default="8,64")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir = build_demo_model(args.model)
    ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    print(f"{'rank':>4s} {'adapters':>8s} {'tok/s (median)':>15s} {'min-max':>15s} "
          f"{'vs base':>8s}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for rank in ranks:
            paths = write_adapters(model_dir, Path(tmp), rank, max(ADAPTERS))
            runs = run_rank(str(model_dir), rank, paths, args)
            base = statistics.median(runs[0])
            for distinct in ADAPTERS:
                median = statistics.median(runs[distinct])
                spread = f"{min(runs[distinct]):.0f}-{max(runs[distinct]):.0f}"
                print(f"{rank:4d} {distinct:8d} {median:15.1f} {spread:>15s} "
                      f"{median / base:8.2f}", flush=True)


if __name__ == "__main__":
    main()
