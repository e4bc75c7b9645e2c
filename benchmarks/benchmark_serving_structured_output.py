"""Benchmark structured-output serving against a running `vllm serve` (or any OpenAI-compatible
server), and check every structured output against its schema, regex, choice or grammar.

Example (server: `vllm serve demo-tiny`, which serves compact JSON by default;
add `--structured-outputs-config.backend xgrammar|guidance` to the server to measure one
backend, or pass `--structured-outputs-backend` to `benchmarks/structured_sweep.py`):

    python benchmarks/benchmark_serving_structured_output.py --model demo-tiny \
        --dataset json --structured-output-ratio 0.5 --num-prompts 32 --output-len 128
"""

from __future__ import annotations

import sys

from vllm.benchmarks.structured_output import main

if __name__ == "__main__":
    sys.exit(main())
