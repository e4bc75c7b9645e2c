"""`vllm serve -dp 2`: two engine cores behind one API server.

Both engines take requests (counted per engine in /metrics), seeded requests spread over
both give what one engine gives, an abort reaches the engine that holds the request (its
engine counts an abort of a live request), a killed engine core fails only its own requests
while the other keeps serving and /health names it, and once every engine is dead /health
and generation requests are 503s.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.utils_wait import wait_until

MODEL = "demo-tiny"


# Shorter than a KV block, so no prompt's attention reads another's cached prefix.
SEEDED_PROMPTS = ["Hello", "def f(", "Once upon", "1, 2,", "SELECT", "Dear", "In the", "<b>"]


@pytest.fixture(scope="module")
def server(start_server):
    # One thread per engine, as the one-engine reference below runs: CPU kernels round by
    # their thread count. A death is seen from the process itself, not the periodic check:
    # with a 600 s interval the kills below are still seen at once (the last one idle).
    return start_server(MODEL, "-dp", "2", "--max-model-len", "512", "--disable-log-requests",
                        "--health-check-interval", "600", env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def one_engine(one_thread_per_rank) -> list[str]:
    """What `-dp 1` (one engine, in this process) writes for the seeded requests."""
    from vllm import LLM, SamplingParams

    llm = LLM(MODEL, max_model_len=512)
    try:
        params = [SamplingParams(temperature=1.0, top_p=0.9, seed=1000 + i, max_tokens=12,
                                 ignore_eos=True) for i in range(len(SEEDED_PROMPTS))]
        outs = llm.generate(SEEDED_PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].text for o in outs]


def _metric(server, name: str) -> dict[str, float]:
    """Samples of metric `name` by their `engine` label ("" when it has none)."""
    text = httpx.get(server.url("/metrics"), timeout=10).text
    out = {}
    for m in re.finditer(rf'^{re.escape(name)}(?:_total)?{{([^}}]*)}} (\S+)$', text, re.M):
        engine = re.search(r'engine="(\d+)"', m.group(1))
        out[engine.group(1) if engine else ""] = float(m.group(2))
    return out


def _complete(server, prompt: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(server.url("/v1/completions"), timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})


def _engine_pids(server) -> list[int]:
    m = re.search(r"engine core pid ([\d, ]+)\)", server.log())
    assert m, server.log()
    return [int(p) for p in m.group(1).split(", ")]


def test_both_engines_serve(server) -> None:
    assert len(_engine_pids(server)) == 2
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda i: _complete(server, f"request {i}"), range(8)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in responses)
    routed = _metric(server, "vllm:data_parallel_requests_routed")
    assert set(routed) == {"0", "1"} and min(routed.values()) >= 1, routed
    assert sum(routed.values()) == 8
    assert _metric(server, "vllm:data_parallel_engine_alive") == {"0": 1.0, "1": 1.0}
    # Each engine's gauges and counters are its own series, labelled with its rank (its
    # snapshot may trail the responses a little).
    for gauge in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert wait_until(lambda g=gauge: set(_metric(server, g)) == {"0", "1"},
                          timeout_s=20, interval_s=0.2), _metric(server, gauge)
    generated = _metric(server, "vllm:generation_tokens")
    assert set(generated) == {"0", "1"} and min(generated.values()) >= 8, generated


def test_seeded_requests_give_what_one_engine_gives(server, one_engine) -> None:
    before = _metric(server, "vllm:data_parallel_requests_routed")

    def complete(i: int) -> httpx.Response:
        return httpx.post(server.url("/v1/completions"), timeout=120, json={
            "model": MODEL, "prompt": SEEDED_PROMPTS[i], "max_tokens": 12, "ignore_eos": True,
            "temperature": 1.0, "top_p": 0.9, "seed": 1000 + i})

    with ThreadPoolExecutor(len(SEEDED_PROMPTS)) as pool:
        responses = list(pool.map(complete, range(len(SEEDED_PROMPTS))))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    routed = _metric(server, "vllm:data_parallel_requests_routed")
    # Both engines sampled some of them.
    assert all(routed[e] > before.get(e, 0.0) for e in ("0", "1")), (before, routed)
    got = [r.json()["choices"][0]["text"] for r in responses]
    assert got == one_engine


def test_an_abort_reaches_the_engine_holding_the_request(server) -> None:
    before = sum(_metric(server, "vllm:engine_aborted_requests").values())
    body = {"model": MODEL, "prompt": "go", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    # Occupy one engine, so the stream below is the only request of the other.
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as first:
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: "))
        # Leaving the block closed the second stream: the server aborts that request.
        assert wait_until(
            lambda: sum(_metric(server, "vllm:engine_aborted_requests").values()) >= before + 1,
            timeout_s=20, interval_s=0.2), "no engine found the aborted request alive"


def test_a_dead_engine_fails_only_its_requests(server) -> None:
    body = {"model": MODEL, "prompt": "go", "max_tokens": 300, "ignore_eos": True,
            "stream": True}
    events: dict[int, list[str]] = {0: [], 1: []}
    started = [threading.Event(), threading.Event()]

    def stream(i: int) -> None:
        with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events[i].append(line[len("data: "):])
                    started[i].set()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in (0, 1)]
    for i, thread in enumerate(threads):
        thread.start()
        assert started[i].wait(60)
    # Least loaded first: the two streams run on different engines.
    victim = _engine_pids(server)[1]
    os.kill(victim, signal.SIGKILL)
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive()
    outcomes = []
    for i in (0, 1):
        assert events[i][-1] == "[DONE]"
        last = json.loads(events[i][-2])
        outcomes.append("error" if "error" in last else last["choices"][0]["finish_reason"])
    assert sorted(outcomes) == ["error", "length"], outcomes

    health = httpx.get(server.url("/health"), timeout=10)
    assert health.status_code == 200
    assert list(health.json()["dead_engines"]) == ["1"], health.json()
    assert _metric(server, "vllm:data_parallel_engine_alive") == {"0": 1.0, "1": 0.0}
    # New requests go to the engine that is left.
    for i in range(3):
        r = _complete(server, f"after {i}")
        assert r.status_code == 200, r.text


def test_every_engine_dead_is_a_503(server) -> None:
    """Runs after test_a_dead_engine_fails_only_its_requests: engine 1 is gone already, and
    engine 0 dies idle."""
    survivor = _engine_pids(server)[0]
    os.kill(survivor, signal.SIGKILL)
    # The front end notices the death on its own (the wait's bound is only a safety net).
    seen: list[httpx.Response] = []

    def unhealthy() -> bool:
        seen.append(httpx.get(server.url("/health"), timeout=30))
        return seen[-1].status_code != 200

    wait_until(unhealthy, interval_s=0.2)
    health = seen[-1]
    assert health.status_code == 503, health.text
    assert _metric(server, "vllm:data_parallel_engine_alive") == {"0": 0.0, "1": 0.0}
    for path, body in [
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3}),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}),
        ("/v1/chat/completions", {"model": MODEL, "max_tokens": 3,
                                  "messages": [{"role": "user", "content": "x"}]}),
    ]:
        r = httpx.post(server.url(path), json=body, timeout=30)
        assert r.status_code == 503, (path, r.status_code, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
