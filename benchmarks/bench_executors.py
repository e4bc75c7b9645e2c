"""Offline throughput of the uni and mp executors, with and without async scheduling, and the
mp executor's RPC round trip, measured side by side in one run.

    python benchmarks/bench_executors.py [--model demo] [--num-prompts 64] [--output-len 128]

Every configuration generates the same greedy tokens (ignore_eos); the script checks that they
are identical and prints tokens/s, ratios, and round-trip latencies (also as JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from typing import Any

import zmq

from vllm import LLM, SamplingParams
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

_TOPICS = [
    "the ocean", "a mountain village", "quantum computers", "the history of tea", "a lost robot",
    "jazz music", "the first moon landing", "bread baking", "a city at night", "honey bees",
    "chess openings", "a haunted library", "solar power", "medieval castles", "the desert",
    "origami",
]


def make_prompts(n: int) -> list[str]:
    """n distinct prompts of varied length."""
    return [
        f"Request {i}: write a short story about {_TOPICS[i % len(_TOPICS)]}" + " in detail" * (i % 5)
        for i in range(n)
    ]


def _echo_loop(rpc_address: str, reply_address: str) -> None:
    """Raw ZMQ echo server (the floor under the executor's round trip)."""
    ctx = zmq.Context(1)
    rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    rx.bind(rpc_address)
    tx.connect(reply_address)
    while (msg := rx.recv_multipart())[0] != b"stop":
        tx.send_multipart(msg)
    rx.close(linger=0)
    tx.close()
    ctx.term()


def raw_zmq_rtt_us(n: int) -> float:
    """Median round trip of a one-frame message between two processes over ipc:// PUSH/PULL."""
    with tempfile.TemporaryDirectory(prefix="bench-zmq-") as d:
        ctx = zmq.Context(1)
        rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        rx.bind(f"ipc://{d}/reply")
        tx.connect(f"ipc://{d}/rpc")
        proc = multiprocessing.get_context("spawn").Process(
            target=_echo_loop, args=(f"ipc://{d}/rpc", f"ipc://{d}/reply")
        )
        proc.start()
        samples = []
        for i in range(n + 50):
            t = time.perf_counter()
            tx.send_multipart([b"x"])
            rx.recv_multipart()
            if i >= 50:
                samples.append(time.perf_counter() - t)
        tx.send_multipart([b"stop"])
        proc.join()
        rx.close(linger=0)
        tx.close(linger=0)
        ctx.term()
    return statistics.median(samples) * 1e6


def executor_rtt_us(executor: MultiprocExecutor, n: int) -> dict[str, float]:
    """Blocking collective_rpc of a no-op (median, p90), and the per-call cost when n calls
    are in flight at once."""
    for _ in range(50):
        executor.collective_rpc(id)
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        executor.collective_rpc(id)
        samples.append(time.perf_counter() - t)
    samples.sort()
    t = time.perf_counter()
    futures = [executor.collective_rpc(id, non_block=True) for _ in range(n)]
    for f in futures:
        f.result()
    pipelined = (time.perf_counter() - t) / n
    return {
        "median_us": statistics.median(samples) * 1e6,
        "p90_us": samples[int(0.9 * len(samples))] * 1e6,
        "pipelined_per_call_us": pipelined * 1e6,
    }


def run(model: str, backend: str, async_scheduling: bool, prompts: list[str], output_len: int) -> dict[str, Any]:
    """Builds an LLM, warms it up, times one generate over all prompts, shuts it down."""
    llm = LLM(
        model,
        distributed_executor_backend=backend,
        async_scheduling=async_scheduling,
        max_num_seqs=max(len(prompts), 1),
    )
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    result: dict[str, Any] = {
        "backend": backend,
        "async_scheduling": async_scheduling,
        "seconds": elapsed,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
    }
    result["tokens_per_s"] = result["output_tokens"] / elapsed
    executor = llm.llm_engine.engine_core.model_executor
    if isinstance(executor, MultiprocExecutor):
        result["rpc"] = executor_rtt_us(executor, 1000)
    llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--json", default=None, help="Write the results to this file.")
    args = parser.parse_args()
    prompts = make_prompts(args.num_prompts)
    results = []
    for backend in ("uni", "mp"):
        for async_scheduling in (False, True):
            r = run(args.model, backend, async_scheduling, prompts, args.output_len)
            results.append(r)
            mode = "async" if async_scheduling else "sync"
            print(f"{backend:>3} {mode:>5}: {r['output_tokens']} tokens in {r['seconds']:.2f} s = "
                  f"{r['tokens_per_s']:.1f} tok/s", flush=True)
    floor = raw_zmq_rtt_us(1000)
    same = all(r["token_ids"] == results[0]["token_ids"] for r in results)
    by_key = {(r["backend"], r["async_scheduling"]): r["tokens_per_s"] for r in results}
    print(f"identical tokens across all four: {same}")
    for backend in ("uni", "mp"):
        print(f"{backend} async/sync: {by_key[(backend, True)] / by_key[(backend, False)]:.3f}")
    for mode in (False, True):
        print(f"{'async' if mode else 'sync'} mp/uni: {by_key[('mp', mode)] / by_key[('uni', mode)]:.3f}")
    for r in results:
        if "rpc" in r:
            rpc = r["rpc"]
            print(f"mp {'async' if r['async_scheduling'] else 'sync'} RPC round trip: median "
                  f"{rpc['median_us']:.0f} us, p90 {rpc['p90_us']:.0f} us, pipelined "
                  f"{rpc['pipelined_per_call_us']:.0f} us/call")
    print(f"raw ZMQ ipc round trip (floor): median {floor:.0f} us; cores: {os.cpu_count()}")
    if args.json:
        summary = {
            "args": vars(args),
            "identical_tokens": same,
            "raw_zmq_rtt_us": floor,
            "results": [{k: v for k, v in r.items() if k != "token_ids"} for r in results],
        }
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
