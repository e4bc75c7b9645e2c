"""Where a decode step's time goes, per op type per layer, in the engine and in the bare
decode loop over the same weights, at several batch sizes, in one run.

    .venv/bin/python benchmarks/bench_layers.py [--model smollm2] [--batch-sizes 1,8,32,64] \
        [--context 64] [--steps 24] [--repeats 3] [--json RESULT.json]

The engine is an in-process `LLM` (synchronous scheduling, so one step's calls never overlap
the next's); the bare loop is vllm/model_executor/greedy_decode_loop.py on the same checkpoint
(the engine's weight layout: fused q/k/v and gate/up, column-major, the same row plans). Each
batch runs `--steps` greedy tokens after a prompt of `--context` seeded random tokens, engine
then bare loop, `--repeats` times. Only the decode steps (one new token per request) count.

Per layer, in microseconds: the input and post-attention norms with their residual adds,
the q/k/v product, RoPE, attention (the KV-cache write included), the output product, the
gate/up product, the activation, the down product, and the rest of the layer (its own
Python and glue). Per step, in milliseconds: everything in the forward pass outside the layers
(embedding, final norm, the LM head) and everything outside the forward pass (the engine's
scheduler, input preparation, sampler and outputs; the bare loop's argmax). A step's time is
the median interval between two decode forward passes; engine ÷ bare is the bare loop's step
time over the engine's (a throughput ratio), per round, as median (min-max). Times are wall
clock, the median over rounds; each wrapped call costs about a microsecond of timer overhead.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm import LLM, SamplingParams

# Per-layer op types, in the order of a layer.
LAYER_OPS = ("norm", "qkv", "rope", "attention", "o_proj", "gate_up", "act", "down")


# What the timers read: wall clock, or the calling thread's CPU time (--clock thread).
_CLOCK: Callable[[], float] = time.perf_counter


class OpTimer:
    """Seconds (of _CLOCK) spent in wrapped calls, by op type, while `on`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, obj: Any, attr: str, category: str | Callable[..., str | None]) -> None:
        """Replaces obj.attr with a timed call of the original. `category` is the op type, or
        a function of the call's arguments that gives it (None: not timed)."""
        original = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            name = category(*args, **kwargs) if callable(category) else category
            if not self.on or name is None:
                return original(*args, **kwargs)
            start = _CLOCK()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name] += _CLOCK() - start

        setattr(obj, attr, timed)


class StepClock:
    """Start times of the forward passes of one run: a time for a decode pass, None for any
    other (a prefill), which ends a run of decode steps."""

    def __init__(self) -> None:
        self.starts: list[float | None] = []

    @property
    def decode_steps(self) -> int:
        """The decode passes recorded."""
        return sum(1 for t in self.starts if t is not None)

    def step_seconds(self) -> float:
        """The mean interval between a decode pass and the next when that one is a decode
        pass too (an interval with a prefill in it would count the prefill)."""
        gaps = [b - a for a, b in zip(self.starts, self.starts[1:])
                if a is not None and b is not None]
        return sum(gaps) / len(gaps) if gaps else float("nan")


def instrument_engine(llm: LLM, timer: OpTimer, clock: StepClock) -> Any:
    """Wraps the engine model's modules by op type; returns the model. Only decode passes
    (every request one new token) are timed."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    model = llm.llm_engine.engine_core.model_executor.worker.model_runner.model
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, RMSNorm) and ".layers." in name:
            timer.wrap(module, "forward", "norm")
        elif isinstance(module, RotaryEmbedding):
            timer.wrap(module, "forward", "rope")
        elif isinstance(module, SiluAndMul):
            timer.wrap(module, "forward", "act")
        elif leaf in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            timer.wrap(module, "forward", leaf.removesuffix("_proj"))
        elif leaf == "self_attn":
            timer.wrap(module.attn, "forward", "attention")
    for layer in model.model.layers:
        timer.wrap(layer, "forward", "layer")
    forward = model.forward

    def timed_forward(input_ids, positions, kv_caches, attn_metadata, *rest, **kwargs):
        timer.on = attn_metadata.max_query_len == 1
        if not timer.on:
            clock.starts.append(None)
            return forward(input_ids, positions, kv_caches, attn_metadata, *rest, **kwargs)
        start = _CLOCK()
        clock.starts.append(start)
        try:
            return forward(input_ids, positions, kv_caches, attn_metadata, *rest, **kwargs)
        finally:
            timer.seconds["forward"] += _CLOCK() - start

    model.forward = timed_forward
    timer.wrap(model, "compute_logits", "lm_head")
    return model


def instrument_bare(decoder: Any, timer: OpTimer, clock: StepClock) -> None:
    """Wraps the bare loop's per-op methods by op type; only decode passes are timed."""
    timer.wrap(decoder, "_layer", "layer")
    timer.wrap(decoder, "_add_norm", "norm")
    timer.wrap(decoder, "_qkv", "qkv")
    timer.wrap(decoder, "_rope", "rope")
    timer.wrap(decoder, "_attend", "attention")
    timer.wrap(decoder, "_act", "act")
    timer.wrap(decoder, "_head", "lm_head")
    products = {"self_attn.o_proj": "o", "mlp.gate_up_proj": "gate_up", "mlp.down_proj": "down"}
    # The q/k/v product is inside _qkv, timed there.
    timer.wrap(decoder, "_linear", lambda x, name: products.get(name.split(".", 3)[-1]))
    forward = decoder.forward

    def timed_forward(tokens, positions, cache, rows, mask, out=None):
        timer.on = mask is not None and tokens.shape[1] == 1
        if not timer.on:
            clock.starts.append(None)
            return forward(tokens, positions, cache, rows, mask, out)
        start = _CLOCK()
        clock.starts.append(start)
        try:
            return forward(tokens, positions, cache, rows, mask, out)
        finally:
            timer.seconds["forward"] += _CLOCK() - start

    decoder.forward = timed_forward


def summarize(timer: OpTimer, clock: StepClock, num_layers: int) -> dict[str, float]:
    """Microseconds per layer of each op type and milliseconds per step of the rest."""
    s = timer.seconds
    steps = max(clock.decode_steps, 1)
    per_layer = 1e6 / (steps * num_layers)
    row = {op: s.get(op, 0.0) * per_layer for op in LAYER_OPS}
    # The engine's q/k/v/o products are named by their module ("o" for o_proj).
    row["o_proj"] = s.get("o", 0.0) * per_layer
    layer = s.get("layer", 0.0) * per_layer
    row["rest of layer"] = layer - sum(row[op] for op in LAYER_OPS)
    row["layer"] = layer
    row["step (ms)"] = clock.step_seconds() * 1e3
    row["forward (ms/step)"] = s.get("forward", 0.0) * 1e3 / steps
    row["layers (ms/step)"] = s.get("layer", 0.0) * 1e3 / steps
    row["lm_head (ms/step)"] = s.get("lm_head", 0.0) * 1e3 / steps
    return row


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(batch)]


def run_engine(llm: LLM, model: Any, prompts: list[list[int]], steps: int, timer: OpTimer,
               clock: StepClock) -> dict[str, float]:
    """One timed generate of `steps` greedy tokens per prompt; the row of summarize."""
    timer.seconds.clear()
    clock.starts.clear()
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    row = summarize(timer, clock, model.num_layers)
    # The engine's LM head runs after its forward pass.
    head_ms = row["lm_head (ms/step)"]
    row["embed, final norm, LM head (ms/step)"] = (
        row["forward (ms/step)"] - row["layers (ms/step)"] + head_ms)
    row["outside the model (ms/step)"] = row["step (ms)"] - row["forward (ms/step)"] - head_ms
    return row


def run_bare(decoder: Any, prompts: list[list[int]], steps: int, timer: OpTimer,
             clock: StepClock) -> dict[str, float]:
    """The bare loop's row of summarize for the same prompts and steps."""
    timer.seconds.clear()
    clock.starts.clear()
    decoder.generate(prompts, steps + 1)
    row = summarize(timer, clock, decoder.num_layers)
    # The bare loop's LM head (_head) runs inside its forward pass.
    row["embed, final norm, LM head (ms/step)"] = (
        row["forward (ms/step)"] - row["layers (ms/step)"])
    row["outside the model (ms/step)"] = row["step (ms)"] - row["forward (ms/step)"]
    return row


ROWS = (*LAYER_OPS, "rest of layer", "layer", "embed, final norm, LM head (ms/step)",
        "outside the model (ms/step)", "step (ms)")


def print_table(batch: int, engine: list[dict[str, float]], bare: list[dict[str, float]]
                ) -> dict[str, Any]:
    """Prints one batch's table (medians over rounds) and returns it."""
    ratios = [b["step (ms)"] / e["step (ms)"] for e, b in zip(engine, bare, strict=True)]
    med = {key: (statistics.median(r[key] for r in engine),
                 statistics.median(r[key] for r in bare)) for key in ROWS}
    print(f"\nbatch {batch}: engine ÷ bare (throughput) {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f}-{max(ratios):.2f})")
    print(f"| {'op (us per layer unless named)':38s} | {'engine':>9s} | {'bare':>9s} | "
          f"{'engine/bare':>11s} |")
    print(f"|{'-' * 40}|{'-' * 11}|{'-' * 11}|{'-' * 13}|")
    for key in ROWS:
        e, b = med[key]
        ratio = f"{e / b:.2f}" if b > 0 else "-"
        print(f"| {key:38s} | {e:9.1f} | {b:9.1f} | {ratio:>11s} |")
    return {"engine_over_bare": ratios, "engine": engine, "bare": bare}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=24, help="decode steps per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="thread: the CPU time of the thread that runs the model, steadier "
                             "on a shared machine; only meaningful with OMP_NUM_THREADS=1 (it "
                             "misses other threads' work, and the engine's host work between "
                             "forward passes may run on another thread)")
    args = parser.parse_args()
    global _CLOCK
    _CLOCK = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.steps < 3 or args.repeats < 1 or args.context < 1:
        parser.error("--steps must be at least 3, --repeats and --context at least 1")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    # Every prompt of a batch is prefilled in one step, so decode steps never share a step
    # with prefill chunks.
    llm = LLM(args.model, async_scheduling=False, max_num_seqs=max(batches),
              max_model_len=args.context + args.steps + 16,
              max_num_batched_tokens=max(8192, args.context * max(batches)))
    # Imported once the engine is built (its thread policy applies before torch starts).
    from vllm.model_executor.greedy_decode_loop import BareDecoder
    from vllm.transformers_utils.hub import resolve_model_path

    try:
        engine_timer, engine_clock = OpTimer(), StepClock()
        model = instrument_engine(llm, engine_timer, engine_clock)
        decoder = BareDecoder(resolve_model_path(args.model))
        bare_timer, bare_clock = OpTimer(), StepClock()
        instrument_bare(decoder, bare_timer, bare_clock)
        vocab = decoder.vocab_size
        warm = _prompts(2, args.context, vocab, seed=0)
        run_engine(llm, model, warm, 3, engine_timer, engine_clock)
        run_bare(decoder, warm, 3, bare_timer, bare_clock)
        results: dict[str, Any] = {}
        for batch in batches:
            engine_rows, bare_rows = [], []
            for round_ in range(args.repeats):
                prompts = _prompts(batch, args.context, vocab, seed=1000 * batch + round_)
                engine_rows.append(run_engine(llm, model, prompts, args.steps, engine_timer,
                                              engine_clock))
                bare_rows.append(run_bare(decoder, prompts, args.steps, bare_timer,
                                          bare_clock))
            results[str(batch)] = print_table(batch, engine_rows, bare_rows)
    finally:
        llm.shutdown()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
