"""Mixture of experts: decode tokens/s of a MoE model against a dense model with the same
active parameters per token, in one run.

    python benchmarks/bench_moe.py [--model demo-small-vocab-deep] [--num-experts 8] \
        [--top-k 2] [--batch-sizes 1,16] [--output-len 64] [--repeats 3]

The dense model is `--model` itself (a Qwen3 with MLP width I). The MoE model is a
`Qwen3MoeForCausalLM` with the same attention, embeddings and layers, written here with
transformers (random weights, tokenizer copied), whose experts have width I / top_k: each
token runs top_k experts, so both models do the same MLP arithmetic per token, and the MoE
holds num_experts / top_k times the MLP weights. Cells are interleaved `--repeats` times
(these machines are noisy); the table gives the median tok/s and the ratio MoE / dense.
The expert implementation is whatever VLLM_MOE_BACKEND names (torch by default).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vllm import LLM, SamplingParams
from vllm.model_executor.model_loader.demo_small_vocab import resolve

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def write_moe(dense: Path, dst: Path, num_experts: int, top_k: int) -> None:
    """Writes a random Qwen3-MoE with `dense`'s body and experts of width I / top_k."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    base = json.loads((dense / "config.json").read_text())
    width = base["intermediate_size"]
    if width % top_k:
        raise ValueError(f"--top-k {top_k} does not divide the MLP width {width}")
    keep = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps",
            "tie_word_embeddings", "bos_token_id", "eos_token_id")
    config = Qwen3MoeConfig(
        **{k: base[k] for k in keep if k in base}, intermediate_size=width,
        moe_intermediate_size=width // top_k, num_experts=num_experts,
        num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"], torch_dtype="float32")
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (dense / name).exists():
            shutil.copy(dense / name, dst / name)


def measure(llm: LLM, batch: int, output_len: int) -> float:
    """Generated tokens per second for `batch` greedy requests of `output_len` tokens."""
    prompts = [[100 + i, 200, 300, 400, 500, 600, 700, 800] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo-small-vocab-deep")
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    dense = resolve(args.model) or Path(args.model)
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as workdir:
        moe = Path(workdir) / "moe"
        write_moe(dense, moe, args.num_experts, args.top_k)
        engines = {name: LLM(str(path), max_num_seqs=max(batches), max_model_len=256)
                   for name, path in (("dense", dense), ("moe", moe))}
        try:
            for llm in engines.values():
                measure(llm, max(batches), 4)  # warm up
            rates = {(name, b): [] for name in engines for b in batches}
            for _ in range(args.repeats):
                for b in batches:
                    for name, llm in engines.items():
                        rates[(name, b)].append(measure(llm, b, args.output_len))
        finally:
            for llm in engines.values():
                llm.shutdown()
    print(f"MoE: {args.num_experts} experts, top-{args.top_k}; dense: {dense.name}")
    print(f"{'batch':>5s} {'dense tok/s':>12s} {'moe tok/s':>10s} {'moe/dense':>9s}")
    for b in batches:
        d, m = (statistics.median(rates[(n, b)]) for n in ("dense", "moe"))
        print(f"{b:5d} {d:12.1f} {m:10.1f} {m / d:9.2f}", flush=True)


if __name__ == "__main__":
    main()
