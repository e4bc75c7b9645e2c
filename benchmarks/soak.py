"""Soak: a long overload of one server with mixed, partly hostile traffic, then a check that
nothing leaked.

    .venv/bin/python benchmarks/soak.py [--model demo-tiny] [--duration 600] \
        [--requests 2000] [--load 2.0] [--server-args="-pp 2 --async-scheduling"]

Starts `vllm serve MODEL` with `--server-args`, measures its capacity (completed requests per
second of the workload below with enough clients to keep it full, `--calibrate` seconds), then
sends `--requests` requests at `--load` times that rate, spread over about `--duration`
seconds (arrivals are paced; beyond capacity they queue in the server). The workload: half
structured (JSON schema, regex, choice), streams and whole replies, chat and completions;
`--disconnect` of the requests are streams dropped after two events, `--bad` are
malformed. Reports, and exits non-zero unless all hold:
- no 5xx and no error event for a valid request, and every bad one a 4xx;
- every structured output that finished with "stop" validates;
- afterwards the running and waiting gauges and KV-cache usage are 0;
- the resident memory of the server and its engine processes at the end is within 10% of
  what it was after calibration;
- the server logged no error and no traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                            "maxItems": 3}},
    "required": ["name", "n", "tags"], "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICES = ["alpha", "beta", "gamma"]
STRUCTURED = {
    "json": {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "s", "schema": SCHEMA}}},
    "regex": {"structured_outputs": {"regex": REGEX}},
    "choice": {"structured_outputs": {"choice": CHOICES}},
}
BAD_BODIES = [
    '{"prompt": "hi", "top_k": 2147483648}', '{"prompt": "hi", "temperature": NaN}',
    '{"prompt": "hi", "n": 1000000}', '{"prompt": "hi", "max_tokens": 100000}',
    '{"prompt": "hi", "structured_outputs": {"regex": "[a-"}}', "[" * 5000 + "]" * 5000,
    '{"prompt": "hi", "structured_outputs": {"json": {"anyOf": []}}}',
]


@dataclass
class Tally:
    """What the requests saw."""

    counts: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def add(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1


def check(kind: str, text: str) -> None:
    """Raises unless `text` satisfies the constraint `kind`."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex" and not re.fullmatch(REGEX, text):
        raise ValueError(f"{text!r} does not match {REGEX}")
    elif kind == "choice" and text not in CHOICES:
        raise ValueError(f"{text!r} is not a choice")


async def one(client: httpx.AsyncClient, model: str, rng: random.Random, i: int,
              args: argparse.Namespace, tally: Tally) -> None:
    """Sends request i (bad, disconnecting, structured or plain) and records the outcome."""
    if rng.random() < args.bad:
        tally.add("bad")
        body = rng.choice(BAD_BODIES).replace('{"prompt"', f'{{"model": "{model}", "prompt"')
        r = await client.post("/v1/completions", content=body,
                              headers={"Content-Type": "application/json"})
        if not 400 <= r.status_code < 500:
            tally.failures.append(f"bad request answered {r.status_code}")
        return
    kind = rng.choice(["json", "regex", "choice", None, None, None])
    chat, stream = rng.random() < 0.5, rng.random() < 0.6
    disconnect = stream and rng.random() < args.disconnect / 0.6
    body = {"model": model, "max_tokens": rng.choice([16, 32, 48]), "stream": stream,
            "temperature": 1.0, **(STRUCTURED[kind] if kind else {})}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if chat:
        body["messages"] = [{"role": "user", "content": f"soak {i}"}]
    else:
        body["prompt"] = f"soak request {i}"
    text, reason = "", None
    if not stream:
        r = await client.post(path, json=body)
        if r.status_code != 200:
            tally.failures.append(f"{r.status_code}: {r.text[:200]}")
            return
        choice = r.json()["choices"][0]
        text, reason = (choice["message"]["content"] if chat else choice["text"]), \
            choice["finish_reason"]
    else:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                tally.failures.append(f"stream {r.status_code}")
                return
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    tally.failures.append(f"error event: {event['error']}")
                    return
                for c in event["choices"]:
                    text += (c["delta"].get("content") or "") if chat else c["text"]
                    reason = c["finish_reason"] or reason
                events += 1
                if disconnect and events >= 2:
                    tally.add("disconnected")
                    return
    tally.add(f"finish_{reason}")
    if kind is not None and reason == "stop":
        try:
            check(kind, text)
            tally.add(f"valid_{kind}")
        except Exception as e:  # noqa: BLE001 - reported
            tally.failures.append(f"invalid {kind}: {text!r}: {e}")


async def calibrate(base: str, model: str, seconds: float, clients: int,
                    args: argparse.Namespace) -> float:
    """Completed valid requests per second with `clients` closed-loop clients."""
    tally = Tally()
    quiet = argparse.Namespace(**{**vars(args), "bad": 0.0, "disconnect": 0.0})
    deadline = time.monotonic() + seconds
    done = 0

    async def client_loop(c: int) -> None:
        nonlocal done
        rng = random.Random(c)
        async with httpx.AsyncClient(base_url=base, timeout=600) as client:
            while time.monotonic() < deadline:
                await one(client, model, rng, c, quiet, tally)
                done += 1

    start = time.monotonic()
    await asyncio.gather(*(client_loop(c) for c in range(clients)))
    return done / (time.monotonic() - start)


async def soak(base: str, model: str, rate: float, args: argparse.Namespace) -> Tally:
    """Sends args.requests requests at `rate` per second; waits for all of them."""
    tally = Tally()
    rng = random.Random(7)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=3600, limits=limits) as client:
        tasks = []
        start = time.monotonic()
        for i in range(args.requests):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(
                one(client, model, random.Random(rng.random()), i, args, tally)))
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, BaseException):
                tally.failures.append(f"client error: {result!r}")
    return tally


def rss_mib(pid: int) -> float:
    """Resident memory of `pid` and all its descendants, MiB."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
            todo += [int(c) for c in children]
        except OSError:
            continue
    return total


def gauges(base: str) -> dict[str, float]:
    """The running/waiting/KV gauges from /metrics (summed over engines)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        values = [float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$",
                                                  text, re.M)]
        out[name] = sum(values)
    return out


@contextlib.contextmanager
def serve(model: str, server_args: str, port: int
          ) -> Iterator[tuple[subprocess.Popen | None, Any]]:
    """Runs `vllm serve MODEL --port PORT SERVER_ARGS` until healthy and yields (process,
    log file); (None, log) when it exited or was not healthy within 300 s (its log's tail
    is printed). Stops it (SIGTERM, then SIGKILL after 60 s) on exit."""
    base = f"http://127.0.0.1:{port}"
    cmd = [str(Path(sys.executable).with_name("vllm")), "serve", model, "--port", str(port),
           "--disable-log-requests", *shlex.split(server_args)]
    # The server's log goes to a file: a pipe nobody reads would fill and block its logging.
    log = tempfile.NamedTemporaryFile("w+", prefix="vllm-server-", suffix=".log", delete=False)
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                print(Path(log.name).read_text()[-3000:], file=sys.stderr)
                yield None, log
                return
            time.sleep(1)
        yield server, log
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo-tiny")
    parser.add_argument("--server-args", default="-pp 2 --async-scheduling")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--load", type=float, default=2.0)
    parser.add_argument("--calibrate", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--disconnect", type=float, default=0.2)
    parser.add_argument("--bad", type=float, default=0.1)
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    with serve(args.model, args.server_args, args.port) as (server, log):
        if server is None:
            return 2
        capacity = asyncio.run(calibrate(base, args.model, args.calibrate, args.clients, args))
        rate = max(args.load * capacity, args.requests / args.duration)
        rss_start = rss_mib(server.pid)
        print(f"capacity {capacity:.2f} req/s; sending {args.requests} at {rate:.2f} req/s "
              f"({rate / capacity:.1f}x); RSS {rss_start:.0f} MiB", flush=True)
        start = time.monotonic()
        tally = asyncio.run(soak(base, args.model, rate, args))
        elapsed = time.monotonic() - start
        time.sleep(2)  # the last stats snapshot
        after = gauges(base)
        rss_end = rss_mib(server.pid)
    print(f"{args.requests} requests in {elapsed:.0f} s; {json.dumps(tally.counts, sort_keys=True)}")
    print(f"gauges after: {after}; RSS {rss_start:.0f} -> {rss_end:.0f} MiB "
          f"({rss_end / rss_start:.3f}x)")
    errors = [line for line in Path(log.name).read_text().splitlines()
              if line.startswith(("ERROR", "Traceback", "CRITICAL"))]
    print(f"server log {log.name}: {len(errors)} error lines")
    problems = list(tally.failures) + [f"server log: {line[:200]}" for line in errors[:5]]
    if any(v != 0 for v in after.values()):
        problems.append(f"gauges not back to 0: {after}")
    if not 0.9 <= rss_end / rss_start <= 1.1:
        problems.append(f"RSS moved {rss_end / rss_start:.3f}x")
    for p in problems[:20]:
        print("FAIL:", p)
    print("PASS" if not problems else f"{len(problems)} problems")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
