"""Bad requests get 4xx errors in OpenAI's shape, never 500; API keys are enforced; many bad
requests mixed with good ones leave no leaked KV blocks or requests behind."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import openai
import pytest

MODEL = "demo-tiny"
API_KEY = "sk-test-key"
MAX_MODEL_LEN = 256
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
LONG_PROMPT = "Hello world " * MAX_MODEL_LEN  # two tokens per repeat: over the context


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64",
                        "--disable-log-requests", api_key=API_KEY)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers(), timeout=60) as c:
        yield c


def assert_error(response: httpx.Response, status: int, param: str | None = "<any>") -> dict:
    """Checks status and OpenAI's error shape; returns the error object."""
    assert response.status_code == status, response.text
    # One clean line whatever went wrong: no traceback, no terminal escapes (raw or escaped).
    for marker in ("Traceback", "\x1b[", "\\u001b", "\\n"):
        assert marker not in response.text, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["code"] == status
    if param != "<any>":
        assert error["param"] == param, error
    return error


# (endpoint, body or raw bytes, expected status, expected param or "<any>")
BAD_REQUESTS = [
    (CHAT, b'{"model": "demo-tiny", "messages": [', 400, None),
    (CHAT, b"[1, 2, 3]", 400, None),
    (COMPLETIONS, b"\xff\xfe not utf-8", 400, None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "bogus_field": 1}, 400, "bogus_field"),
    (CHAT, {"model": MODEL}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": [], "max_tokens": 4}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"content": "no role"}]}, 400, "<any>"),
    (COMPLETIONS, {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    # Echoed input must not smuggle escapes or a fake traceback into the message.
    (COMPLETIONS, {"model": "\x1b[31mred\x1b[0m\nTraceback (most recent call last):\n  File x",
                   "prompt": "x"}, 404, "model"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "logprobs": 99}, 400, "logprobs"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    (COMPLETIONS, {"model": MODEL, "prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": [10**9]}, 400, "prompt_token_ids"),
    (COMPLETIONS, {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4}, 400, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400,
     "max_tokens"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}]}, 400,
     "prompt"),
    (CHAT, {"model": MODEL, "messages": MESSAGES,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x",
                                                "schema": {"type": "no-such-type"}}}},
     400, "<any>"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_schema"}},
     400, "response_format.json_schema"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "yaml"}},
     400, "<any>"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "guided_json": "{not json"}, 400,
     "structured_outputs.json"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "guided_regex": "[a-"}, 400,
     "structured_outputs.regex"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x",
                   "structured_outputs": {"grammar": "root ::= ( \"a\""}}, 400,
     "structured_outputs.grammar"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "guided_choice": []}, 400,
     "structured_outputs.choice"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x",
                   "structured_outputs": {"regex": "a+", "choice": ["a"]}}, 400,
     "structured_outputs"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_object"},
            "guided_regex": "a+"}, 400, "structured_outputs"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "guided_json": {"type": "object"},
            "structured_outputs": {"choice": ["a"]}}, 400, "structured_outputs"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "structured_outputs": {}}, 400,
     "structured_outputs"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "top_logprobs": 3}, 400, "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "stream_options": {"include_usage": True}},
     400, "stream_options"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function"}]}, 400,
     "tools.0.function"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, 400,
     "tool_choice"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "logit_bias": {"x": 1.0}}, 400, "logit_bias"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "logit_bias": {"999999999": 1}}, 400,
     "logit_bias"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "allowed_token_ids": []}, 400,
     "allowed_token_ids"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "allowed_token_ids": [10**9]}, 400,
     "allowed_token_ids"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "bad_words": [""]}, 400, "bad_words"),
    # OpenAI fields that would change the reply and are not implemented here.
    (CHAT, {"model": MODEL, "messages": MESSAGES, "modalities": ["text", "audio"]}, 400,
     "modalities"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "audio": {"voice": "alloy"}}, 400, "audio"),
    (CHAT, {"model": MODEL, "messages": MESSAGES,
            "prediction": {"type": "content", "content": "x"}}, 400, "prediction"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "functions": [{"name": "f"}]}, 400,
     "functions"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "guided_regex": "a+",
            "guided_decoding_backend": "bogus"}, 400, "structured_outputs.backend"),
    (CHAT, {"model": MODEL, "messages": MESSAGES,
            "structured_outputs": {"regex": "a+", "backend": "lm_format_enforcer"}}, 400,
     "structured_outputs.backend"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, 400,
     "top_logprobs"),
    # Values that overflowed the runner's int32/int64 columns and killed the engine core.
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 4, "top_k": 2**31}, 400,
     "top_k"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 4, "seed": 2**64}, 400, "seed"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 2**64}, 400,
     "min_tokens"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "seed": -(2**64)}, 400,
     "seed"),
    # Unbounded fan-out froze the server.
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 1, "n": 1_000_000}, 400, "n"),
    (COMPLETIONS, {"model": MODEL, "prompt": ["a"] * 20, "max_tokens": 1, "n": 10}, 400, "n"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 1, "stop": ["s"] * 1000}, 400,
     "stop"),
    (CHAT, {"model": MODEL, "messages": MESSAGES * (MAX_MODEL_LEN + 1), "max_tokens": 1}, 400,
     "messages"),
    # Non-finite numbers were accepted and sampled garbage.
    (COMPLETIONS, b'{"model": "demo-tiny", "prompt": "hi", "max_tokens": 2, "temperature": NaN}',
     400, None),
    (COMPLETIONS, b'{"model": "demo-tiny", "prompt": "hi", "temperature": Infinity}', 400, None),
    (COMPLETIONS, b'{"model": "demo-tiny", "prompt": "hi", "top_p": -Infinity}', 400, None),
    (COMPLETIONS, b'{"model": "demo-tiny", "prompt": "hi", "temperature": 1e309}', 400, None),
    (CHAT, b'{"model": "demo-tiny", "messages": [{"role": "user", "content": "hi"}], '
           b'"repetition_penalty": NaN}', 400, None),
    # Malformed input that was a 500.
    (COMPLETIONS, b"[" * 10000 + b"]" * 10000, 400, None),
    (COMPLETIONS, b'{"model": "demo-tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400,
     None),
    (CHAT, b'{"model": "demo-tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
     400, "messages[0].content"),
    (COMPLETIONS, b'{"model": "demo-tiny", "prompt": "a\\udfff b"}', 400, "prompt"),
    (COMPLETIONS, b'{"model": "demo-\\ud800", "prompt": "hi"}', 400, "model"),
    (COMPLETIONS, b'{"model": "demo-tiny", "prompt": "hi", "stop": ["\\ud800"]}', 400,
     "stop[0]"),
]


def _send(http: httpx.Client, endpoint: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(endpoint, content=body, headers={"Content-Type": "application/json"})
    return http.post(endpoint, json=body)


@pytest.mark.parametrize("endpoint,body,status,param", BAD_REQUESTS)
def test_bad_request(http, endpoint, body, status, param):
    assert_error(_send(http, endpoint, body), status, param)


def test_openai_client_raises_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=MESSAGES)


@pytest.mark.parametrize(
    "method,path",
    [("GET", "/v1/models"), ("POST", COMPLETIONS), ("POST", CHAT), ("GET", "/v1/nowhere"),
     ("GET", "/metrics"), ("GET", "/version"), ("GET", "/nowhere")],
)
@pytest.mark.parametrize("key", [None, "wrong-key", API_KEY + "x"])
def test_api_key_required_on_every_route_but_health(server, method, path, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "prompt": "x", "messages": MESSAGES, "max_tokens": 2}
    r = httpx.request(method, server.url(path), headers=headers,
                      json=body if method == "POST" else None, timeout=30)
    assert_error(r, 401)


def test_api_key_accepted_and_open_routes(server, http):
    assert http.get("/v1/models").status_code == 200
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    # /health is the one route open without the key; the others open with it.
    assert httpx.get(server.url("/health"), timeout=30).status_code == 200
    for path in ("/version", "/metrics"):
        assert http.get(path).status_code == 200


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/completions"), 405)
    assert_error(http.post("/v1/embeddings", json={}), 404)


def test_many_bad_requests_mixed_with_good_leak_nothing(server):
    """200 requests, three quarters bad, sent concurrently: every good one succeeds, every
    bad one is a 4xx, and afterwards no request or KV block is left behind."""
    rng = random.Random(0)
    good = [
        (COMPLETIONS, {"model": MODEL, "prompt": f"good {i}", "max_tokens": 4, "seed": i})
        for i in range(25)
    ] + [
        (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "stream": True})
        for _ in range(15)
    ] + [
        (COMPLETIONS, {"model": MODEL, "prompt": "n", "max_tokens": 8,
                       "guided_regex": "[a-z]{1,4}"})
        for _ in range(10)
    ]
    bad = [rng.choice(BAD_REQUESTS) for _ in range(150)]
    jobs = [("good", e, b, 200) for e, b in good] + [("bad", e, b, s) for e, b, s, _ in bad]
    rng.shuffle(jobs)
    assert len(jobs) == 200

    async def run() -> list[tuple[str, int, httpx.Response]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers(),
                                     timeout=120, limits=limits) as client:
            async def one(kind, endpoint, body, status):
                if isinstance(body, bytes):
                    r = await client.post(endpoint, content=body,
                                          headers={"Content-Type": "application/json"})
                else:
                    r = await client.post(endpoint, json=body)
                return kind, status, r
            return await asyncio.gather(*(one(k, e, b, s) for k, e, b, s in jobs))

    results = asyncio.run(run())
    for kind, status, r in results:
        if kind == "good":
            assert r.status_code == 200, r.text
            if "data: " in r.text:
                assert r.text.rstrip().endswith("data: [DONE]")
                assert '"error"' not in r.text
            else:
                assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        else:
            assert_error(r, status)
    m = server.wait_idle()
    assert m["vllm:kv_cache_free_blocks"] == m["vllm:kv_cache_total_blocks"] > 0
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
    assert m["vllm:num_requests_api_server"] == 0
    assert httpx.get(server.url("/health"), timeout=30).status_code == 200


def test_oversized_body_is_413_and_server_stays_up(server, http):
    big = b'{"model": "demo-tiny", "prompt": "' + b"a" * (17 << 20) + b'"}'
    assert_error(http.post(COMPLETIONS, content=big,
                           headers={"Content-Type": "application/json"}), 413)

    def chunks():  # no Content-Length: the limit must hold while reading
        yield b'{"model": "demo-tiny", "messages": [{"role": "user", "content": "'
        for _ in range(17):
            yield b"b" * (1 << 20)
        yield b'"}]}'

    assert_error(http.post(CHAT, content=chunks(),
                           headers={"Content-Type": "application/json"}), 413)
    assert httpx.get(server.url("/health"), timeout=30).status_code == 200


def test_failed_requests_release_their_request_id(server, http):
    """A request that fails validation must not leave its request_id registered."""
    rid = "reused-request-id"
    for bad in ({"seed": 2**64}, {"top_k": 2**31}, {"n": 10**6}, {"stop": ["\ud800"]}):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "request_id": rid, **bad}
        # ensure_ascii keeps the lone surrogate as a \ud800 escape, as a client would send it.
        raw = json.dumps(body).encode()
        assert_error(http.post(COMPLETIONS, content=raw,
                               headers={"Content-Type": "application/json"}), 400)
    ok = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                      "request_id": rid})
    assert ok.status_code == 200, ok.text
    assert server.wait_idle()["vllm:num_requests_api_server"] == 0


def test_an_image_for_a_text_only_model_is_a_400_naming_the_model(http) -> None:
    png = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAA"
           "AElFTkSuQmCC")  # one pixel
    content = [{"type": "text", "text": "what is it?"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png}}]
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    error = assert_error(http.post(CHAT, json=body), 400, "messages[0].content[1]")
    assert f"model {MODEL!r} does not take images" in error["message"]
    assert http.post(CHAT, json={"model": MODEL, "max_tokens": 2,
                                 "messages": MESSAGES}).status_code == 200
