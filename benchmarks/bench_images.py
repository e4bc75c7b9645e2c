"""Images in: requests/s and vision-encoder milliseconds per image, by images per batch.

    .venv/bin/python benchmarks/bench_images.py [--model QWEN_VL_DIR] \
        [--family qwen2_5_vl|qwen3_vl] [--batches 1,4,16] [--size 224] [--output-len 16] \
        [--json-schema]

Without `--model` it builds the tiny random Qwen2.5-VL (or, with `--family qwen3_vl`,
Qwen3-VL) the tests use (from the repository's tests/utils_vl.py: run it from the
repository root). Each batch is one `LLM.generate` call of N requests, each with its own
image (`--size` square, random pixels: no two alike, so every image is encoded), greedy,
`--output-len` tokens (with `--json-schema`, under a JSON schema). Encoder time is the wall
time inside the runner's per-image encode (uni executor, same process); a warm-up batch
runs first. Prints one row per batch: requests/s, tokens/s, encoder ms per image and the
encoder's share of the wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from vllm import LLM, SamplingParams, StructuredOutputsParams
from vllm.v1.worker import mm_step

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
SCHEMA = {"type": "object", "properties": {"animal": {"type": "string", "maxLength": 8},
                                           "count": {"type": "integer"}},
          "required": ["animal", "count"]}


def tiny_checkpoint(family: str) -> str:
    """The tests' tiny random Qwen2.5-VL or Qwen3-VL, written to a temporary directory."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.utils_vl import build_vl_checkpoint

    path = Path(tempfile.mkdtemp(prefix="bench-images-"))
    build_vl_checkpoint(path, family=family)
    return str(path)


class EncoderTimer:
    """Wall seconds and calls inside MultiModalInputs._encode (patched on the class)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        original = mm_step.MultiModalInputs._encode

        def timed(inputs, feature):
            start = time.perf_counter()
            try:
                return original(inputs, feature)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        mm_step.MultiModalInputs._encode = timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def requests(n: int, size: int, seed: int) -> list[dict]:
    """n prompts, each with its own random image."""
    rng = np.random.default_rng(seed)
    prompt = (f"<|im_start|>user\n{PLACEHOLDER}Describe the picture.<|im_end|>\n"
              "<|im_start|>assistant\n")
    return [{"prompt": prompt, "multi_modal_data": {"image": Image.fromarray(
        rng.integers(0, 256, (size, size, 3), dtype=np.uint8))}} for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the tests' tiny model")
    parser.add_argument("--family", choices=["qwen2_5_vl", "qwen3_vl"], default="qwen2_5_vl",
                        help="which tiny model, without --model")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--json-schema", action="store_true")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    timer = EncoderTimer()
    llm = LLM(args.model or tiny_checkpoint(args.family), max_num_seqs=max(batches),
              distributed_executor_backend="uni")
    params = SamplingParams(
        temperature=0.0, max_tokens=args.output_len, ignore_eos=not args.json_schema,
        structured_outputs=StructuredOutputsParams(json=SCHEMA) if args.json_schema else None)
    llm.generate(requests(2, args.size, seed=999), params, use_tqdm=False)  # warm-up
    rows = []
    for i, n in enumerate(batches):
        batch = requests(n, args.size, seed=i)
        timer.reset()
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"images": n, "requests_per_s": round(n / wall, 3),
                     "tokens_per_s": round(tokens / wall, 1),
                     "encoder_ms_per_image": round(1000 * timer.seconds / max(timer.calls, 1), 2),
                     "encoder_share": round(timer.seconds / wall, 3),
                     "encodes": timer.calls})
    llm.shutdown()
    print("| images per batch | requests/s | tokens/s | encoder ms/image | encoder share |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['images']} | {r['requests_per_s']} | {r['tokens_per_s']} | "
              f"{r['encoder_ms_per_image']} | {r['encoder_share']:.1%} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
