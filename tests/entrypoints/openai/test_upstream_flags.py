"""`vllm serve` with an upstream command line: a hub id from the hub cache (offline), upstream
flags that have no effect here, which start the server with one warning each, and the chat
template and generation-config flags."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.transformers_utils.test_hub import build_hub_cache
from tests.utils_wait import wait_until

from .conftest import RemoteServer

CHAT_TEMPLATE = ("{{ greeting }}|{% for m in messages %}{{ m.role }}:{{ m.content }};"
                 "{% endfor %}")
NO_EFFECT = ("--disable-frontend-multiprocessing", "--enable-prompt-tokens-details",
             "--log-error-stack", "--disable-log-stats", "--swap-space", "4",
             "--no-enable-chunked-prefill")


def test_serve_hub_id_with_upstream_flags(start_server, tmp_path: Path) -> None:
    """Also --chat-template with --default-chat-template-kwargs, and
    --override-generation-config over the model's generation config (which sets no
    temperature: vLLM's 1.0 would apply)."""
    cache = build_hub_cache(tmp_path / "hub")
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    server: RemoteServer = start_server(
        "org/tiny", "--max-model-len", "256", "--tokenizer-mode", "auto",
        "--config-format", "hf", "--load-format", "auto", "--max-num-batched-tokens", "64",
        "--chat-template", str(template), "--default-chat-template-kwargs",
        '{"greeting": "hello"}', "--generation-config", "auto",
        "--override-generation-config", '{"temperature": 0}',
        *NO_EFFECT,
        env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)},
    )
    log = server.log()
    assert "serving model 'org/tiny'" in log and str(cache) in log
    assert "async scheduling: on" in log
    for flag in ("--disable-frontend-multiprocessing", "--enable-prompt-tokens-details",
                 "--log-error-stack", "disable_log_stats", "swap_space",
                 "enable_chunked_prefill=False"):
        assert log.count(f"{flag} has no effect") == 1, flag
    out = server.client().completions.create(model="org/tiny", prompt="Hi", max_tokens=4,
                                             temperature=0)
    assert out.usage.completion_tokens == 4
    # The override makes a request that leaves temperature unset greedy; one that sets it
    # samples (seeded: three samples, not all the greedy text).
    greedy = out.choices[0].text
    unset = server.client().completions.create(model="org/tiny", prompt="Hi", max_tokens=4,
                                               n=3, seed=1)
    assert [c.text for c in unset.choices] == [greedy] * 3
    hot = server.client().completions.create(model="org/tiny", prompt="Hi", max_tokens=4,
                                             n=3, seed=1, temperature=1.0)
    assert [c.text for c in hot.choices] != [greedy] * 3
    # The template renders chat messages with the default variables, which a request's
    # chat_template_kwargs override.
    for kwargs, want in (({}, "hello|user:Hi;"), ({"greeting": "bye"}, "bye|user:Hi;")):
        body = {"model": "org/tiny", "messages": [{"role": "user", "content": "Hi"}],
                "chat_template_kwargs": kwargs}
        tokens = httpx.post(server.url("/tokenize"), json=body).json()["tokens"]
        text = httpx.post(server.url("/detokenize"),
                          json={"model": "org/tiny", "tokens": tokens}).json()["prompt"]
        assert text == want


def test_serve_with_tls_cors_and_a_root_path(start_server, tmp_path: Path) -> None:
    """--ssl-keyfile/--ssl-certfile serve HTTPS; --allowed-origins answers browsers' CORS
    preflights (before the API key, which preflights never carry); --root-path is the prefix
    a proxy serves the API under."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    origin = "https://app.example"
    server: RemoteServer = start_server(
        "demo-tiny", "--max-model-len", "256", "--ssl-keyfile", str(key), "--ssl-certfile",
        str(cert), "--allowed-origins", json.dumps([origin]), "--root-path", "/api",
        api_key="sk-tls", https=True)
    with httpx.Client(base_url=server.base_url, verify=str(cert)) as http:
        out = http.post("/v1/completions", headers=server.headers(),
                        json={"model": "demo-tiny", "prompt": "Hi", "max_tokens": 2})
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 2
        pre = http.options("/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == origin
        other = http.options("/v1/chat/completions", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in other.headers
        spec = http.get("/openapi.json", headers=server.headers()).json()
        assert spec["servers"][0]["url"] == "/api"
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url("/health").replace("https", "http"), timeout=5)


def test_overload_sheds_new_requests_and_keeps_serving(start_server) -> None:
    """--max-waiting-requests 0 with one sequence at a time: while one long request runs,
    a second generation request gets a 503 with Retry-After at once (tokenize still
    answers); once the first is gone (its client left) the server serves again."""
    server: RemoteServer = start_server("demo", "--max-model-len", "4096",
                                        "--max-num-seqs", "1", "--max-waiting-requests", "0")
    long_body = {"model": "demo", "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True,
                 "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=long_body) as long_run:
            assert long_run.status_code == 200
            assert wait_until(lambda: server.metrics().get("vllm:num_requests_running") == 1
                              ), "the long request never ran"
            shed = http.post("/v1/chat/completions", json={
                "model": "demo", "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2})
            tokenized = http.post("/tokenize", json={"model": "demo", "prompt": "x"})
        # Leaving the stream disconnected its client: the long request is aborted.
        assert shed.status_code == 503 and shed.headers["retry-after"] == "1", shed.text
        assert "--max-waiting-requests" in shed.json()["error"]["message"]
        assert tokenized.status_code == 200
        answers: list[httpx.Response] = []

        def admitted() -> bool:
            answers.append(http.post("/v1/completions", json={
                "model": "demo", "prompt": "Hi", "max_tokens": 2}))
            return answers[-1].status_code != 503

        wait_until(admitted, interval_s=0.1)
        assert answers[-1].status_code == 200, "the aborted request was never released"


def test_a_burst_is_shed_at_the_bound(start_server) -> None:
    """1,000 requests opened at once against --max-waiting-requests 16 (4 sequences at a
    time): the gate counts each from its first byte, not from its admission to the engine,
    so most of the burst gets 503 with Retry-After, the engine's waiting queue never grows
    past the bound plus one batch, and the server serves normally afterwards."""
    import asyncio

    server: RemoteServer = start_server("demo-tiny", "--max-model-len", "256",
                                        "--max-num-seqs", "4", "--max-waiting-requests", "16")
    body = {"model": "demo-tiny", "prompt": "Hi", "max_tokens": 8, "ignore_eos": True}
    peak = [0.0]
    done = asyncio.Event()

    async def watch(http: httpx.AsyncClient) -> None:
        while not done.is_set():
            text = (await http.get("/metrics")).text
            for line in text.splitlines():
                if line.startswith("vllm:num_requests_waiting{"):
                    peak[0] = max(peak[0], float(line.rsplit(" ", 1)[1]))
            await asyncio.sleep(0.05)

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=1100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300,
                                     limits=limits) as http:
            watcher = asyncio.create_task(watch(http))
            answers = await asyncio.gather(
                *(http.post("/v1/completions", json=body) for _ in range(1000)))
            done.set()
            await watcher
            return answers

    answers = asyncio.run(burst())
    ok = [a for a in answers if a.status_code == 200]
    shed = [a for a in answers if a.status_code == 503]
    assert len(ok) + len(shed) == 1000, {a.status_code for a in answers}
    assert ok and len(shed) >= 500, (len(ok), len(shed))
    assert all(a.headers["retry-after"] == "1" for a in shed)
    assert "--max-waiting-requests" in shed[0].json()["error"]["message"]
    assert peak[0] <= 16 + 4, peak[0]
    after = httpx.post(server.url("/v1/completions"), json=body, timeout=120)
    assert after.status_code == 200
