"""Decode throughput and weight memory of quantized weights vs full precision, in one run.

    python benchmarks/bench_quantization.py [--model demo-small-vocab-deep] \
        [--batch-sizes 1,16] [--output-len 64] [--group-size 128]

Variants of one model: full precision; ``--quantization fp8`` (each projection quantized
to per-channel FP8 at load); and a compressed-tensors W4A16 checkpoint (symmetric int4,
one scale per ``--group-size`` columns) written here with the compressed-tensors library.
Each batch runs once to warm up and once measured; the table gives tok/s, the ratio to
full precision and the loaded weight bytes. On a CPU every quantized layer dequantizes its
weight in every forward, so expect ratios below 1 there; on a GPU, FP8 with
torch._scaled_mm reads half the weight bytes of bf16, and W4A16's Triton kernel about a
quarter, so memory-bound decode should gain up to those factors (neither measured yet).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from bench_decode import measure  # the same timing as the decode benchmark

from vllm import LLM
from vllm.model_executor.model_loader.demo_small_vocab import resolve
from vllm.model_executor.model_loader.weight_utils import weight_bytes


def write_w4a16(src: Path, dst: Path, group_size: int) -> None:
    """Writes src's model as a compressed-tensors W4A16 checkpoint at dst (tokenizer
    files copied): every projection but the LM head, scales from each group's range."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*", "config.json"))
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group_size,
                            symmetric=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme},
                                                     ignore=["lm_head"]), show_progress=False)
    for module in hf.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        w = module.weight.detach().view(module.weight.shape[0], -1, group_size)
        scale, _ = calculate_qparams(w.amin(-1), w.amax(-1), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(hf)
    compressor.compress_model(hf)
    hf.save_pretrained(dst)
    compressor.update_config(str(dst))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo-small-vocab-deep")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    src = resolve(args.model) or Path(args.model)
    results: dict[str, tuple[int, dict[int, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-quant-") as workdir:
        w4a16 = Path(workdir) / "w4a16"
        write_w4a16(src, w4a16, args.group_size)
        variants = [("full precision", src, None), ("fp8 (at load)", src, "fp8"),
                    (f"W4A16 g{args.group_size}", w4a16, None)]
        for label, path, quantization in variants:
            llm = LLM(str(path), quantization=quantization, max_num_seqs=max(batches),
                      max_model_len=256)
            try:
                runner = llm.llm_engine.engine_core.model_executor.worker.model_runner
                rates = {b: measure(llm, b, args.output_len) for b in batches}
                results[label] = (weight_bytes(runner.model), rates)
                print(f"{label:18s} " + "  ".join(f"batch {b}: {r:8.1f} tok/s"
                                                  for b, r in rates.items()), flush=True)
            finally:
                llm.shutdown()
    base_bytes, base = results["full precision"]
    print("\nvariant              weight MiB  (x full)  " +
          "  ".join(f"b{b} tok/s (x full)" for b in batches))
    for label, (size, rates) in results.items():
        cells = "  ".join(f"{rates[b]:9.1f} ({rates[b] / base[b]:4.2f})" for b in batches)
        print(f"{label:18s} {size / 2**20:10.1f}  ({size / base_bytes:5.2f})  {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
