"""The engine's own host cost per step, by phase, with a forward pass that costs nothing.

    .venv/bin/python benchmarks/bench_step_overhead.py [--model demo] \
        [--batch-sizes 1,8,64,256] [--output-len 32] [--json RESULT.json] [--profile]

The model's forward is replaced by one that returns zeros (the LM head still runs, on the
real vocabulary, and is reported apart), so what remains per step is the engine: scheduling,
input preparation, the sampler, the grammar bitmask, output processing, detokenization and
the per-request metrics.
Each cell (batch x 0 / 100 % JSON x sync / async) runs once on the uni executor; phases are
timed by wrapping the engine's methods (wall time inside the calls; under async they may
overlap, and `update` includes waiting for the step's result). A second table runs the real model at
each batch under async and prints the fraction of the wall time the forward pass was busy
(the layers alone, and with the LM head and the sampler: "model busy").
JSON requests follow bench_offline.py's `structured_schema`, whose minimum string length keeps
even the tilted demo models writing all output_len tokens, so a JSON cell's batch stays full
to the end like a plain one's; a cell whose requests stop early is flagged (its steps ran a
smaller batch) and the script exits with status 1.
`--profile` adds, after each null-forward cell, the functions with the most own time
(cProfile, in the engine's thread and in the worker's calls, which may run on another thread).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from bench_offline import shortfall, structured_schema  # the sibling script
from vllm import LLM, SamplingParams, StructuredOutputsParams
from vllm.transformers_utils import detokenizer

if TYPE_CHECKING:
    import torch
PHASES = ("schedule", "prepare", "lm_head", "sample", "bitmask", "update", "output", "detok",
          "metrics")


class Timers:
    """Seconds spent in each wrapped call, by phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        """Replaces obj.name by a timed call of the original (side effect: patches obj)."""
        original: Callable = getattr(obj, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(obj, name, timed)


def _null_forward(hidden_size: int, dtype: torch.dtype):
    # Imported here, once the engine is built: torch loaded before it would start OpenMP
    # without the engine's thread policy, and its idle threads would spin on the cores the
    # engine's Python threads need (vllm/thread_policy.py), inflating every async phase.
    import torch

    def forward(input_ids, positions, kv_caches, metadata, intermediate=None):
        return torch.zeros(input_ids.shape[0], hidden_size, dtype=dtype, device=input_ids.device)
    return forward


def instrument(llm: LLM, null_model: bool) -> tuple[Timers, dict[str, int]]:
    """Timers on the engine's phases, and a counter of forward passes."""
    timers, counts = Timers(), {"steps": 0}
    engine = llm.llm_engine
    core = engine.engine_core
    runner = core.model_executor.worker.model_runner
    model = runner.model
    if null_model:
        model.forward = _null_forward(model.hidden_size, runner.dtype)
    timers.wrap(core.scheduler, "schedule", "schedule")
    timers.wrap(core.scheduler, "update_from_output", "update")
    timers.wrap(core.structured_output_manager, "grammar_bitmask", "bitmask")
    timers.wrap(model, "compute_logits", "lm_head")
    timers.wrap(model, "forward", "forward")
    timers.wrap(runner.sampler, "forward", "sample")
    timers.wrap(engine.output_processor, "process_outputs", "output")
    timers.wrap(engine, "_record_outputs", "metrics")  # request stats and token metrics
    execute = runner.execute_model

    def counted(scheduler_output):
        if scheduler_output.total_num_scheduled_tokens:
            counts["steps"] += 1
        start = time.perf_counter()
        try:
            return execute(scheduler_output)
        finally:
            timers.seconds["execute"] += time.perf_counter() - start

    runner.execute_model = counted
    return timers, counts


class Profiles:
    """cProfile of the calling thread (enable/disable) and of the worker's calls, which the
    uni executor may run on its own thread, where a profiler must be enabled per call."""

    def __init__(self, llm: LLM) -> None:
        self.main = cProfile.Profile()
        self.worker = cProfile.Profile()
        self.on = False
        runner = llm.llm_engine.engine_core.model_executor.worker.model_runner
        for name in ("execute_model", "sample_tokens"):
            self._wrap(runner, name)

    def _wrap(self, obj: Any, name: str) -> None:
        original: Callable = getattr(obj, name)

        @functools.wraps(original)
        def profiled(*args, **kwargs):
            if not self.on or threading.current_thread() is threading.main_thread():
                return original(*args, **kwargs)  # the main thread's profiler sees it
            self.worker.enable()
            try:
                return original(*args, **kwargs)
            finally:
                self.worker.disable()

        setattr(obj, name, profiled)

    def summary(self, lines: int = 15) -> str:
        """The top functions by own time, each profiler, and resets them."""
        out = io.StringIO()
        for name, profile in (("engine thread", self.main), ("worker calls", self.worker)):
            if not profile.getstats():
                continue
            out.write(f"-- {name}\n")
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(lines)
        self.main, self.worker = cProfile.Profile(), cProfile.Profile()
        return out.getvalue()


def run_cell(llm: LLM, timers: Timers, counts: dict[str, int], batch: int, output_len: int,
             structured: bool, null_model: bool,
             profiles: Profiles | None = None) -> dict[str, float]:
    """Per-step milliseconds of every phase, and the forward's share of the wall time."""
    timers.seconds.clear()
    counts["steps"] = 0
    so = (StructuredOutputsParams(json=structured_schema(output_len), disable_any_whitespace=True)
          if structured else None)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=not structured,
                            structured_outputs=so)
    prompts = [[100 + i, 200, 300, 400] for i in range(batch)]
    detok_seconds = [0.0]
    update = detokenizer.IncrementalDetokenizer.update

    def timed_update(self, new_token_ids):
        start = time.perf_counter()
        try:
            return update(self, new_token_ids)
        finally:
            detok_seconds[0] += time.perf_counter() - start

    detokenizer.IncrementalDetokenizer.update = timed_update
    try:
        if profiles is not None:
            profiles.on = True
            profiles.main.enable()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    finally:
        if profiles is not None:
            profiles.main.disable()
            profiles.on = False
        detokenizer.IncrementalDetokenizer.update = update
    s = timers.seconds
    steps = max(counts["steps"], 1)
    s["detok"] = detok_seconds[0]
    s["output"] -= s["detok"]  # detokenization happens inside output processing
    s["prepare"] = s["execute"] - s["forward"] - (s["lm_head"] if not null_model else 0.0)
    if null_model:
        s["prepare"] -= s["lm_head"]
    row = {phase: 1000 * s[phase] / steps for phase in PHASES}
    row["host_total"] = sum(row[p] for p in PHASES if p != "lm_head")
    row["wall_per_step"] = 1000 * wall / steps
    row["forward_busy"] = s["forward"] / wall if wall else 0.0
    # What a GPU would run on the device: the layers, the LM head and the sampler.
    row["model_busy"] = (s["forward"] + s["lm_head"] + s["sample"]) / wall if wall else 0.0
    row["steps"] = steps
    row["tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
    return row


def _engine(model: str, async_scheduling: bool, max_num_seqs: int, output_len: int) -> LLM:
    """An engine warmed up on plain and JSON requests (the grammar compiled before timing)."""
    llm = LLM(model, async_scheduling=async_scheduling, max_num_seqs=max_num_seqs,
              max_model_len=256)
    so = StructuredOutputsParams(json=structured_schema(output_len), disable_any_whitespace=True)
    llm.generate(["warm up"] * 2, [SamplingParams(max_tokens=output_len),
                                   SamplingParams(max_tokens=output_len, structured_outputs=so)],
                 use_tqdm=False)
    return llm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--batch-sizes", default="1,8,64,256")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="print a cProfile summary after each null-forward cell")
    parser.add_argument("--modes", default="sync,async",
                        help="comma-separated scheduling modes of the null-forward table")
    parser.add_argument("--real", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the real model's forward-busy table")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    results: dict[str, Any] = {"null": {}, "real": {}}
    short: list[str] = []
    print(f"Host milliseconds per step (null forward; LM head apart), output {args.output_len}")
    print("| mode | JSON | batch | " + " | ".join(PHASES) + " | host total | wall/step |")
    print("|---" * (len(PHASES) + 5) + "|")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in ("sync", "async") for m in modes):
        parser.error("--modes: each mode must be sync or async")
    for mode in modes:
        async_scheduling = mode == "async"
        llm = _engine(args.model, async_scheduling, max(batches), args.output_len)
        timers, counts = instrument(llm, null_model=True)
        profiles = Profiles(llm) if args.profile else None
        for structured in (False, True):
            for batch in batches:
                row = run_cell(llm, timers, counts, batch, args.output_len, structured, True,
                               profiles)
                key = f"{mode}/{int(structured) * 100}/{batch}"
                results["null"][key] = row
                warning = shortfall(row["tokens"], batch, args.output_len)
                if warning is not None:
                    short.append(f"{key}: {warning}")
                    print(f"!! {key}: {warning}")
                cells = " | ".join(f"{row[p]:.2f}" for p in PHASES)
                print(f"| {mode} | {int(structured) * 100}% | {batch} | {cells} | "
                      f"{row['host_total']:.2f} | {row['wall_per_step']:.2f} |")
                if profiles is not None:
                    print(profiles.summary())
        llm.shutdown()
    if not args.real:
        return _finish(args.json, results, short)
    print("\nReal model, async: the forward pass's share of the wall time (layers only, and "
          "with the LM head and the sampler, which a GPU also runs on the device)")
    print("| batch | forward busy | model busy | wall ms/step |")
    print("|---|---|---|---|")
    llm = _engine(args.model, True, max(batches), args.output_len)
    timers, counts = instrument(llm, null_model=False)
    for batch in batches:
        row = run_cell(llm, timers, counts, batch, args.output_len, False, False)
        results["real"][str(batch)] = row
        print(f"| {batch} | {row['forward_busy']:.0%} | {row['model_busy']:.0%} | "
              f"{row['wall_per_step']:.2f} |")
    llm.shutdown()
    return _finish(args.json, results, short)


def _finish(path: Path | None, results: dict[str, Any], short: list[str]) -> int:
    """Writes the results to `path` if given, repeats the short cells' warnings; the exit
    status (1 when a cell generated fewer tokens than asked)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
    for line in short:
        print(f"!! {line}")
    return 1 if short else 0


if __name__ == "__main__":
    raise SystemExit(main())
