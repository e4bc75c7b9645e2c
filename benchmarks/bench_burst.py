"""Burst: N requests opened at once against a server with `--max-waiting-requests`.

    .venv/bin/python benchmarks/bench_burst.py [--model demo-tiny] [--requests 2000] \
        [--max-waiting-requests 64] [--server-args="-pp 2 --async-scheduling"]

Starts `vllm serve MODEL --max-waiting-requests B SERVER_ARGS`, opens `--requests`
completions at once (one connection each), and polls `/metrics` meanwhile. Prints how many
got 200 and 503, whether every 503 carried `Retry-After`, the peak of
`vllm:num_requests_waiting` (summed over engines) against the bound, the latency of the
admitted requests (p50, p99, max), and whether a request after the burst is served. Exits
non-zero when an answer is neither 200 nor 503, a 503 lacks Retry-After, the peak waiting
exceeds the bound plus the engines' batch (`--max-num-seqs` per engine), or the server does
not serve afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def _soak():
    """benchmarks/soak.py, for its `serve` (this folder is not a package)."""
    spec = importlib.util.spec_from_file_location("soak", Path(__file__).with_name("soak.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("soak", module)
    spec.loader.exec_module(module)
    return module


@dataclass
class BurstResult:
    """What one burst saw."""

    statuses: dict[int, int] = field(default_factory=dict)
    # Seconds from sending to the full answer, of each request that got 200.
    admitted_latency_s: list[float] = field(default_factory=list)
    missing_retry_after: int = 0
    peak_waiting: float = 0.0
    # /metrics answers read during the burst (the peak is only as good as they are many).
    waiting_samples: int = 0

    def summary(self) -> dict[str, float | int]:
        """The counts and latency percentiles, for printing."""
        lat = sorted(self.admitted_latency_s)
        return {
            "ok_200": self.statuses.get(200, 0),
            "shed_503": self.statuses.get(503, 0),
            "other": sum(n for code, n in self.statuses.items() if code not in (200, 503)),
            "missing_retry_after": self.missing_retry_after,
            "peak_waiting": self.peak_waiting,
            "waiting_samples": self.waiting_samples,
            "p50_s": round(percentile(lat, 0.50), 3),
            "p99_s": round(percentile(lat, 0.99), 3),
            "max_s": round(lat[-1], 3) if lat else 0.0,
        }


def percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank q-quantile of `sorted_values` (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = max(1, -(-int(q * 1000) * len(sorted_values) // 1000))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def waiting(metrics_text: str) -> float:
    """vllm:num_requests_waiting summed over every engine's series."""
    return sum(float(v) for v in re.findall(
        r"^vllm:num_requests_waiting(?:\{[^}]*\})? (\S+)$", metrics_text, re.M))


async def burst(base: str, model: str, n: int, max_tokens: int) -> BurstResult:
    """Opens `n` completions at once and records what came back."""
    result = BurstResult()
    body = {"model": model, "prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True}
    done = asyncio.Event()

    async def watch(http: httpx.AsyncClient) -> None:
        while not done.is_set():
            try:
                text = (await http.get("/metrics")).text
                if not done.is_set():
                    result.waiting_samples += 1
                    result.peak_waiting = max(result.peak_waiting, waiting(text))
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)

    async def one(http: httpx.AsyncClient) -> None:
        start = time.monotonic()
        try:
            answer = await http.post("/v1/completions", json=body)
        except httpx.HTTPError:
            result.statuses[-1] = result.statuses.get(-1, 0) + 1
            return
        code = answer.status_code
        result.statuses[code] = result.statuses.get(code, 0) + 1
        if code == 200:
            result.admitted_latency_s.append(time.monotonic() - start)
        elif code == 503 and "retry-after" not in answer.headers:
            result.missing_retry_after += 1

    limits = httpx.Limits(max_connections=n + 16, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
        watcher = asyncio.create_task(watch(http))
        await asyncio.gather(*(one(http) for _ in range(n)))
        done.set()
        await watcher
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo-tiny")
    parser.add_argument("--server-args", default="-pp 2 --async-scheduling")
    parser.add_argument("--port", type=int, default=8012)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--max-waiting-requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16,
                        help="per engine; the bound on peak waiting adds it per engine")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    server_args = (f"{args.server_args} --max-num-seqs {args.max_num_seqs} "
                   f"--max-waiting-requests {args.max_waiting_requests}")
    dp = re.search(r"(?:-dp|--data-parallel-size)[ =](\d+)", args.server_args)
    engines = int(dp.group(1)) if dp else 1
    with _soak().serve(args.model, server_args, args.port) as (server, _log):
        if server is None:
            return 2
        result = asyncio.run(burst(base, args.model, args.requests, args.max_tokens))
        after = httpx.post(f"{base}/v1/completions", timeout=300,
                           json={"model": args.model, "prompt": "Hi", "max_tokens": 4})
    summary = result.summary()
    bound = engines * (args.max_waiting_requests + args.max_num_seqs)
    print(json.dumps({"server_args": server_args, "requests": args.requests, **summary,
                      "waiting_bound": bound, "after_burst": after.status_code}))
    problems = []
    if summary["other"]:
        problems.append(f"{summary['other']} answers were neither 200 nor 503: "
                        f"{result.statuses}")
    if result.missing_retry_after:
        problems.append(f"{result.missing_retry_after} 503s without Retry-After")
    if result.peak_waiting > bound:
        problems.append(f"peak waiting {result.peak_waiting} exceeds {bound}")
    if after.status_code != 200:
        problems.append(f"after the burst: {after.status_code}")
    for p in problems:
        print("FAIL:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
