"""Upstream vLLM's API surfaces beyond chat and completions, against one real server
(demo-think with `--reasoning-parser qwen3`, tool calling and an API key): the metric names
upstream's dashboards read, /tokenize and /detokenize, and /v1/responses."""

from __future__ import annotations

import httpx
import pytest

MODEL = "demo-think"
API_KEY = "sk-upstream"
PHASE_HISTOGRAMS = (
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
)


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(MODEL, "--max-model-len", "1024", "--reasoning-parser", "qwen3",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        api_key=API_KEY)


def test_upstream_request_histograms_count_every_request(server) -> None:
    before = server.wait_idle()
    client = server.client()
    num_requests, produced, prompt_tokens = 3, 0, 0
    for i in range(num_requests):
        reply = client.completions.create(model=MODEL, prompt=f"Count {i}", max_tokens=5 + i,
                                          temperature=0)
        produced += reply.usage.completion_tokens
        prompt_tokens += reply.usage.prompt_tokens
    after = server.wait_idle()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    for name in PHASE_HISTOGRAMS:
        assert delta(f"{name}_count") == num_requests, name
    assert delta("vllm:request_generation_tokens_sum") == produced
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    # Every token after a request's first comes with an inter-token observation at most
    # once per step, so there is at least one and at most (tokens - first tokens).
    itl = delta("vllm:inter_token_latency_seconds_count")
    assert 1 <= itl <= produced - num_requests
    assert delta("vllm:request_queue_time_seconds_sum") >= 0
    assert delta("vllm:request_decode_time_seconds_sum") > 0


def post(server, path: str, body: dict, auth: bool = True) -> httpx.Response:
    headers = server.headers() if auth else {}
    return httpx.post(server.url(path), json=body, headers=headers, timeout=60)


def test_tokenize_a_prompt_and_detokenize_it_back(server) -> None:
    reply = post(server, "/tokenize", {"model": MODEL, "prompt": "Hello world, hello!"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["count"] == len(body["tokens"]) > 1
    assert body["max_model_len"] == 1024
    back = post(server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": "Hello world, hello!"}


def test_tokenize_messages_renders_the_chat_template(server) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    with_prompt = post(server, "/tokenize", {"model": MODEL, "messages": messages}).json()
    without = post(server, "/tokenize", {"model": MODEL, "messages": messages,
                                         "add_generation_prompt": False}).json()
    text = post(server, "/detokenize", {"tokens": with_prompt["tokens"]}).json()["prompt"]
    assert "<|im_start|>user\nHi there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert without["count"] < with_prompt["count"]
    # The same prompt a chat completion reads: its usage counts the same tokens.
    chat = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == with_prompt["count"]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_tokenizer_routes_need_the_api_key(server, path) -> None:
    body = {"prompt": "x"} if path == "/tokenize" else {"tokens": [1]}
    assert post(server, path, body, auth=False).status_code == 401


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"model": MODEL}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_tokenizer_input_is_a_400_naming_the_field(server, path, body, param) -> None:
    reply = post(server, path, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].split(".")[0] == param


def test_tokenize_an_unknown_model_is_a_404(server) -> None:
    reply = post(server, "/tokenize", {"model": "nope", "prompt": "x"})
    assert reply.status_code == 404
    assert reply.json()["error"]["param"] == "model"
