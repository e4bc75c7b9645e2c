"""Where a decode step's time goes, between the host and the device (torch.profiler).

    python benchmarks/gpu_profile.py [--model qwen3-1.7b] [--batch-sizes 1,64,256] \
        [--json-batch 64] [--edits-batch 64] [--steps 6] [--sync] [--no-stack] [--triton] \
        [--out-dir DIR]
    python benchmarks/gpu_profile.py --cpu       (the mechanics on the CPU, for CI)

One engine (async scheduling unless --sync; CUDA graphs as configured by default) decodes
each batch of 8-token prompts; after two warm-up decode steps the profiler records --steps
decode steps, started and stopped on the worker thread that runs them. One more run decodes
--json-batch requests that all follow a JSON schema, and one --edits-batch requests with
presence, frequency and repetition penalties and a logit_bias (which CUDA samples in the
post-layer graphs too). Per step it prints:
  wall ms      from one step's execute_model to the next one's;
  busy ms      the union of the device's kernels, copies and memsets in that window;
  gaps         the device's idle intervals longer than --gap-us, and for the largest three
               what the host was running then (the innermost Python frame, and the
               outermost frame of the engine's own code, when the stacks are recorded);
  launches     graph replays (and the kernels they ran) and kernels launched one by one;
  syncs        host waits (cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize,
               synchronous cudaMemcpy) and device-to-host copies;
and per run the 15 host functions with the most own time (Python frames with --no-stack
unset, else operators). Each run's Chrome trace goes to --out-dir as <run>.json (open it in
chrome://tracing or https://ui.perfetto.dev); profile.json holds every number printed.
--triton first measures the host cost per launch of the engine's Triton kernels
(bench_triton_launch.py).

--cpu runs all of it on the CPU with the tiny demo model (batches 1 and 4, 2 for JSON and
edits, 3 steps): the
"device" intervals are then the operators themselves, no graph replays exist, and the syncs
column counts the operations that would make a CUDA host wait (OpAudit) instead.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize"}
LAUNCH_CALLS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel"}
GRAPH_CALLS = {"cudaGraphLaunch", "cuGraphLaunch"}
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
WARMUP_STEPS = 2


@dataclass
class StepProfile:
    """The numbers of one decode step (see the module docstring)."""

    step: int
    wall_ms: float
    busy_ms: float
    idle_ms: float
    num_gaps: int
    largest_gaps: list[tuple[float, str]]  # (ms, what the host ran)
    graph_replays: int
    graph_kernels: int
    eager_launches: int
    syncs: int
    d2h_copies: int


@dataclass
class RunProfile:
    name: str
    batch: int
    steps: list[StepProfile] = field(default_factory=list)
    host_functions: list[tuple[str, float]] = field(default_factory=list)  # (name, self ms)
    trace: str = ""


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _clip(merged: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in merged if b > lo and a < hi]


def _api_name(name: str) -> str:
    """A CUDA API call's name without the version suffix some CUPTI releases add
    (cudaLaunchKernel_v7000 -> cudaLaunchKernel)."""
    return re.sub(r"_v\d+$", "", name)


def _short(name: str) -> str:
    """A frame name without the directories before the package (vllm/..., torch/...)."""
    for root in ("/vllm/", "/torch/", "/site-packages/"):
        at = name.find(root)
        if at >= 0:
            return name[at + 1 :] if root != "/site-packages/" else name[at + len(root) :]
    return name


def _host_at(t: float, frames: list[dict]) -> str:
    """What the host threads ran at time t: per thread (up to two), the innermost frame, with
    the innermost frame of the engine's own code when that is not it."""
    by_thread: dict[object, list[dict]] = {}
    for e in frames:
        if e["ts"] <= t <= e["ts"] + e["dur"]:
            by_thread.setdefault(e.get("tid"), []).append(e)
    parts = []
    for tid, around in sorted(by_thread.items(), key=lambda kv: -len(kv[1]))[:2]:
        inner = _short(min(around, key=lambda e: e["dur"])["name"])
        ours = [e for e in around if "vllm/" in e["name"]]
        mine = _short(min(ours, key=lambda e: e["dur"])["name"]) if ours else None
        parts.append(f"[{tid}] " + (inner if mine in (None, inner) else f"{mine} > {inner}"))
    return " | ".join(parts) or "(nothing recorded)"


def _self_times(frames: list[dict], python: bool) -> list[tuple[str, float]]:
    """Own time (ms) per frame name, largest first: a Python frame's time less its callees'
    (linked by the profiler's ids), or an operator's whole time."""
    own: dict[str, float] = {}
    if python:
        children: dict[object, float] = {}
        for e in frames:
            parent = e.get("args", {}).get("Python parent id")
            children[parent] = children.get(parent, 0.0) + e["dur"]
        for e in frames:
            mine = e["dur"] - children.get(e.get("args", {}).get("Python id"), 0.0)
            own[_short(e["name"])] = own.get(_short(e["name"]), 0.0) + mine
    else:
        for e in frames:
            own[e["name"]] = own.get(e["name"], 0.0) + e["dur"]
    return sorted(((k, v / 1000) for k, v in own.items()), key=lambda kv: -kv[1])


def analyze(trace: dict, cuda: bool, gap_us: float,
            audits: dict[int, tuple[int, int]] | None = None) -> RunProfile:
    """The per-step numbers of a Chrome trace written by this script's hooks. `audits`
    (CPU mode): per step, (operations that would wait, device-to-host copies) from OpAudit,
    which replace the CUDA runtime's counts."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    marks = [e for e in events if e.get("cat") == "user_annotation"
             and e["name"].startswith("decode step ")]
    starts = sorted((e for e in marks if e["name"].endswith(": execute")), key=lambda e: e["ts"])
    if cuda:
        device = [e for e in events if e.get("cat") in DEVICE_CATS]
    else:
        device = [e for e in events if e.get("cat") == "cpu_op"]
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in device])
    python = [e for e in events if e.get("cat") == "python_function"]
    frames = python or [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    runtime = [dict(e, name=_api_name(e["name"])) for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    graph_ids = {e.get("args", {}).get("correlation") for e in runtime if e["name"] in GRAPH_CALLS}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    run = RunProfile("", 0)
    for i, mark in enumerate(starts):
        number = int(mark["name"].split()[2].rstrip(":"))
        lo = mark["ts"]
        if i + 1 < len(starts):
            hi = starts[i + 1]["ts"]
        else:  # the last step: until its sampling call returns or its device work ends
            own = [e["ts"] + e["dur"] for e in marks if e["name"].startswith(f"decode step {number}:")]
            hi = max(own + [b for _, b in _clip(busy, lo, float("inf"))][-1:])
        inside = _clip(busy, lo, hi)
        busy_us = sum(b - a for a, b in inside)
        edges = [lo] + [x for ab in inside for x in ab] + [hi]
        gaps = [(b - a, a) for a, b in zip(edges[::2], edges[1::2]) if b - a > gap_us]
        gaps.sort(reverse=True)
        window = [e for e in runtime if lo <= e["ts"] < hi]
        replays = [e for e in window if e["name"] in GRAPH_CALLS]
        replay_ids = {e.get("args", {}).get("correlation") for e in replays} & graph_ids
        syncs = sum(e["name"] in SYNC_CALLS for e in window)
        d2h = sum(1 for e in events if e.get("cat") == "gpu_memcpy" and lo <= e["ts"] < hi
                  and "DtoH" in e["name"])
        eager = sum(e["name"] in LAUNCH_CALLS for e in window)
        if not cuda:
            eager = sum(1 for e in device if lo <= e["ts"] < hi)
            syncs, d2h = (audits or {}).get(number, (0, 0))
        run.steps.append(StepProfile(
            step=number, wall_ms=(hi - lo) / 1000, busy_ms=busy_us / 1000,
            idle_ms=(hi - lo - busy_us) / 1000, num_gaps=len(gaps),
            largest_gaps=[(g / 1000, _host_at(start + g / 2, frames)) for g, start in gaps[:3]],
            graph_replays=len(replays),
            graph_kernels=sum(e.get("args", {}).get("correlation") in replay_ids
                              for e in kernels),
            eager_launches=eager, syncs=syncs, d2h_copies=d2h,
        ))
    if starts:
        first = starts[0]["ts"]
        last = max(e["ts"] + e["dur"] for e in marks)
        window_frames = [e for e in frames if first <= e["ts"] and e["ts"] + e["dur"] <= last]
        run.host_functions = _self_times(window_frames, bool(python))[:15]
    return run


class StepHooks:
    """Wraps a model runner's execute_model / sample_tokens: names every step in the trace,
    and starts / stops the profiler around the chosen decode steps on the thread that runs
    them (the profiler records operators of the thread that starts it)."""

    def __init__(self, runner, make_profiler, audit: bool) -> None:
        self.runner = runner
        self.make_profiler = make_profiler
        self.audit = audit
        self.execute, self.sample = runner.execute_model, runner.sample_tokens
        runner.execute_model, runner.sample_tokens = self._execute, self._sample
        self.lock = threading.Lock()
        self.arm(0)

    def arm(self, steps: int) -> None:
        """Profiles decode steps WARMUP_STEPS + 1 .. WARMUP_STEPS + steps of the next run."""
        self.steps = steps
        self.decode_seen = 0
        self.profiler = None
        self.pending: list[tuple[str, object]] = []
        self.audits: dict[int, tuple[int, int]] = {}
        self._stopped = False

    def _execute(self, scheduler_output):
        so = scheduler_output
        decode = (so.total_num_scheduled_tokens > 0 and not so.scheduled_new_reqs
                  and so.total_num_scheduled_tokens == len(so.num_scheduled_tokens))
        with self.lock:
            if decode:
                self.decode_seen += 1
            first, last = WARMUP_STEPS + 1, WARMUP_STEPS + self.steps
            if decode and self.decode_seen == first and self.steps:
                self.profiler = self.make_profiler()
                self.profiler.start()
            elif self.profiler is not None and self.decode_seen == last + 1:
                self.stop()
            label = f"decode step {self.decode_seen}" if decode else "other step"
        audit = None
        if self.audit and self.profiler is not None:
            from vllm.v1.worker.op_audit import OpAudit

            audit = OpAudit("cpu")
        self.pending.append((label, audit))
        return self._call(self.execute, label + ": execute", audit, so)

    def _sample(self, grammar_output):
        label, audit = self.pending.pop(0)
        out = self._call(self.sample, label + ": sample", audit, grammar_output)
        if audit is not None and label.startswith("decode"):
            number = int(label.split()[2])
            syncs, d2h = self.audits.get(number, (0, 0))
            self.audits[number] = (syncs + len(audit.syncs), d2h + len(audit.downloads))
        return out

    @staticmethod
    def _call(fn, name: str, audit, arg):
        import torch

        with ExitStack() as stack:
            stack.enter_context(torch.profiler.record_function(name))
            if audit is not None:
                stack.enter_context(audit)
            return fn(arg)

    def stop(self) -> None:
        """Stops the profiler if it runs (idempotent)."""
        if self.profiler is not None and not self._stopped:
            self.profiler.stop()
            self._stopped = True

    def take(self):
        """The finished profiler of the last run (None if it never started)."""
        with self.lock:
            self.stop()
            profiler, self.profiler, self._stopped = self.profiler, None, False
            return profiler


def _report(run: RunProfile, cuda: bool) -> None:
    print(f"\n== {run.name}: batch {run.batch} ({len(run.steps)} decode steps; trace "
          f"{run.trace})")
    sync_name = "syncs" if cuda else "would-sync ops"
    for s in run.steps:
        share = 100 * s.busy_ms / s.wall_ms if s.wall_ms else 0.0
        print(f"step {s.step:3d}: wall {s.wall_ms:8.3f} ms  busy {s.busy_ms:8.3f} ms "
              f"({share:3.0f}%)  idle {s.idle_ms:7.3f} ms in {s.num_gaps} gaps  "
              f"graphs {s.graph_replays} ({s.graph_kernels} kernels)  eager "
              f"{s.eager_launches}  {sync_name} {s.syncs}  d2h {s.d2h_copies}")
        for ms, host in s.largest_gaps:
            print(f"    gap {ms:7.3f} ms: {host}")
    if run.steps:
        wall = statistics.median(s.wall_ms for s in run.steps)
        busy = statistics.median(s.busy_ms for s in run.steps)
        print(f"median: wall {wall:.3f} ms, busy {busy:.3f} ms per step")
    print("top host functions (own ms over the profiled steps):")
    for name, ms in run.host_functions:
        print(f"  {ms:9.3f}  {name}")


def _runs(args) -> list[tuple[str, int, str]]:
    """(name, batch, kind: decode, json or edits) of each run; the largest batch (the
    largest trace) last."""
    runs = [(f"decode-b{b}", b, "decode") for b in args.batch_sizes]
    for kind, batch in (("json", args.json_batch), ("edits", args.edits_batch)):
        if batch:
            runs.append((f"{kind}-b{batch}", batch, kind))
    largest = max(runs, key=lambda r: (r[1], r[2] == "decode"))
    return [r for r in runs if r is not largest] + [largest]


def main(argv: list[str] | None = None) -> int:
    """Runs the profile (module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: qwen3-1.7b, demo-tiny (--cpu)")
    parser.add_argument("--batch-sizes", default=None, help="default: 1,64,256; 1,4 (--cpu)")
    parser.add_argument("--json-batch", type=int, default=None, help="0: no JSON run")
    parser.add_argument("--edits-batch", type=int, default=None,
                        help="penalties and logit_bias; 0: no such run")
    parser.add_argument("--steps", type=int, default=None, help="profiled decode steps")
    parser.add_argument("--gap-us", type=float, default=20.0)
    parser.add_argument("--sync", action="store_true", help="synchronous scheduling")
    parser.add_argument("--no-stack", action="store_true", help="no Python frames (faster)")
    parser.add_argument("--triton", action="store_true", help="add the Triton launch costs")
    parser.add_argument("--cpu", action="store_true", help="the mechanics on the CPU")
    parser.add_argument("--out-dir", type=Path, default=Path("results/gpu-profile"))
    args = parser.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        print("gpu_profile: needs CUDA (pass --cpu to run its mechanics on the CPU)")
        return 0
    args.model = args.model or ("qwen3-1.7b" if cuda else "demo-tiny")
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("1,64,256" if cuda else "1,4"))
                        .split(",")]
    args.json_batch = (64 if cuda else 2) if args.json_batch is None else args.json_batch
    args.edits_batch = (64 if cuda else 2) if args.edits_batch is None else args.edits_batch
    args.steps = args.steps or (6 if cuda else 3)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
               "model": args.model, "async": not args.sync, "runs": []}

    def save(run: RunProfile | None) -> None:  # after every part: a time cap keeps the rest
        if run is not None:
            summary["runs"].append(asdict(run))
        (args.out_dir / "profile.json").write_text(json.dumps(summary, indent=1))

    if args.triton:  # first: short, and nothing else has loaded the GPU yet
        from bench_triton_launch import measure  # the sibling script

        summary["triton_launch"] = measure(iters=200 if cuda else 2)
        print("Triton launches (host us per call; us per call with the device):")
        for row in summary["triton_launch"]:
            print(f"  {row['kernel']:28s} {row['host_us']:10.1f} {row['wall_us']:10.1f}")
        save(None)
    with tempfile.TemporaryDirectory(prefix="gpu-profile-") as workdir:
        runs = profile_runs(args, cuda, Path(workdir), save)
    return 0 if all(r.steps for r in runs) else 1


def profile_runs(args, cuda: bool, workdir: Path, save) -> list[RunProfile]:
    """Builds the engine and profiles every run (see the module docstring); `save` is called
    with each run's profile as it is done."""
    import torch

    from vllm import LLM, SamplingParams, StructuredOutputsParams
    from vllm.benchmarks.sweep import PRESETS, prepare_model

    preset = next((p for p in PRESETS.values() if p.model == args.model), None)
    model = prepare_model(preset, workdir).serve_arg if preset else args.model
    batches = args.batch_sizes + [args.json_batch, args.edits_batch]
    kwargs = {"load_format": "dummy"} if cuda else {}
    llm = LLM(model, max_num_seqs=max(batches), max_model_len=512 if cuda else 256,
              async_scheduling=not args.sync, **kwargs)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def make_profiler():
        return torch.profiler.profile(activities=activities, with_stack=not args.no_stack)

    runner = llm.llm_engine.engine_core.model_executor.worker.model_runner
    hooks = StepHooks(runner, make_profiler, audit=not cuda)
    out = []
    try:
        for name, batch, kind in _runs(args):
            tokens = WARMUP_STEPS + args.steps + 4
            extra = {}
            if kind == "json":
                from bench_offline import structured_schema  # the sibling script

                extra = {"structured_outputs": StructuredOutputsParams(
                    json=structured_schema(tokens))}
            if kind == "edits":
                extra = {"temperature": 0.8, "presence_penalty": 0.2, "frequency_penalty": 0.5,
                         "repetition_penalty": 1.1, "logit_bias": {100: 2.0, 200: -2.0}}
            params = SamplingParams(**{"temperature": 0.0, "max_tokens": tokens,
                                       "ignore_eos": True, **extra})
            prompts = [[100 + i, 200, 300, 400, 500, 600, 700, 800] for i in range(batch)]
            llm.generate(prompts, params, use_tqdm=False)  # warm up (graphs, grammars)
            hooks.arm(args.steps)
            llm.generate(prompts, params, use_tqdm=False)
            profiler = hooks.take()
            run = RunProfile(name, batch)
            if profiler is not None:
                run.trace = str(args.out_dir / f"{name}.json")
                profiler.export_chrome_trace(run.trace)
                trace = json.loads(Path(run.trace).read_text())
                run = analyze(trace, cuda, args.gap_us, hooks.audits)
                run.name, run.batch, run.trace = name, batch, str(args.out_dir / f"{name}.json")
            _report(run, cuda)
            save(run)
            out.append(run)
    finally:
        llm.shutdown()
    return out


if __name__ == "__main__":
    sys.exit(main())
