"""Completions and chat completions through the official openai client against `vllm serve`."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from vllm import __version__

MODEL = "demo-tiny"
PROMPT = "The quick brown fox jumps over the lazy dog because"
MESSAGES = [{"role": "user", "content": "Tell me a story about a fox."}]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(MODEL, "--max-model-len", "512", "--max-num-seqs", "32")


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url("/health")).status_code == 200
    assert httpx.get(server.url("/version")).json() == {"version": __version__}


def test_completion_basic(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0)
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 7
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0)
    assert again.choices[0].text == choice.text  # greedy is deterministic


def test_completion_token_prompt_and_echo(server, client):
    ids = [9707, 1879]  # "Hello world" in Qwen's vocabulary
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, echo=True,
                                    temperature=0)
    assert out.usage.prompt_tokens == 2
    assert out.choices[0].text.startswith("Hello world")
    plain = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3,
                                      temperature=0)
    assert out.choices[0].text == "Hello world" + plain.choices[0].text


def test_completion_multiple_prompts_and_n(client):
    out = client.completions.create(
        model=MODEL, prompt=["one", "two two"], n=2, max_tokens=4, temperature=1.0, seed=5
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 4 * 4
    by_index = {c.index: c.text for c in out.choices}
    # Each of the n samples gets its own seed, so they differ.
    assert by_index[0] != by_index[1]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streaming_equals_non_streaming(client, endpoint):
    kwargs = dict(model=MODEL, max_tokens=24, temperature=1.0, seed=1234)
    if endpoint == "completions":
        full = client.completions.create(prompt=PROMPT, **kwargs)
        stream = client.completions.create(
            prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **kwargs
        )
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        expected = full.choices[0].text
    else:
        full = client.chat.completions.create(messages=MESSAGES, **kwargs)
        stream = client.chat.completions.create(
            messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **kwargs
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expected = full.choices[0].message.content
    assert text == expected
    finishes = [c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    # include_usage: the last chunk has no choices and the same usage as the full response.
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_basic_and_max_completion_tokens(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=5,
                                         temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 5
    assert out.choices[0].finish_reason == "length"
    out2 = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                          temperature=0)
    assert out2.choices[0].message.content == out.choices[0].message.content


def test_chat_n_streaming(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=3, max_tokens=6, temperature=1.0, seed=9, stream=True
    )
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    full = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=3, max_tokens=6, temperature=1.0, seed=9
    )
    assert {c.index: c.message.content for c in full.choices} == texts


def _stop_candidate(text: str) -> str:
    """A 2-character stop string whose first occurrence is well inside `text`."""
    for start in range(3, len(text) - 2):
        s = text[start:start + 2]
        if s.strip() and text.find(s) == start:
            return s
    pytest.fail(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(client, include, stream):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=1.0, seed=77)
    text = client.completions.create(**kwargs).choices[0].text
    stop = _stop_candidate(text)
    pos = text.find(stop)
    expected = text[: pos + len(stop)] if include else text[:pos]
    extra = {"include_stop_str_in_output": include}
    if stream:
        chunks = list(client.completions.create(stop=[stop, "\x00never"], stream=True,
                                                extra_body=extra, **kwargs))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        assert reasons == ["stop"]
    else:
        out = client.completions.create(stop=[stop, "\x00never"], extra_body=extra, **kwargs)
        got = out.choices[0].text
        assert out.choices[0].finish_reason == "stop"
        assert out.choices[0].model_extra["stop_reason"] == stop
    assert got == expected


def test_completion_logprobs(server, client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=3,
                                    temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and top
        assert sampled <= 0.0
        # Greedy: the sampled token is the most likely one.
        assert math.isclose(sampled, max(top.values()), rel_tol=1e-5, abs_tol=1e-5)


def test_chat_logprobs_streaming_matches(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=3,
                  logprobs=True, top_logprobs=4)
    full = client.chat.completions.create(**kwargs)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == full.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 4
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert t.logprob <= values[0] + 1e-6
        assert bytes(t.bytes).decode("utf-8") == t.token
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                streamed.extend(c.logprobs.content)
    assert [(t.token, round(t.logprob, 5)) for t in streamed] == [
        (t.token, round(t.logprob, 5)) for t in content
    ]


def test_sampling_knobs_accepted(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.8, top_p=0.9, seed=1,
        presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
                    "min_tokens": 8},
    )
    assert out.usage.completion_tokens == 8
    # top_k=1 is greedy.
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    topk1 = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0,
                                      seed=2, extra_body={"top_k": 1})
    assert topk1.choices[0].text == greedy.choices[0].text


def test_logit_bias_allowed_token_ids_and_bad_words(client):
    """OpenAI's logit_bias (string keys) forces or bans tokens; allowed_token_ids and
    bad_words (upstream's extensions) travel in extra_body."""
    forced = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=1.0, seed=1,
        logit_bias={"9707": 100}, logprobs=True, extra_body={"ignore_eos": True})
    assert [t.token for t in forced.choices[0].logprobs.content] == ["Hello"] * 4
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"return_tokens_as_token_ids": True},
                                      logprobs=0)
    first = int(plain.choices[0].logprobs.tokens[0].split(":")[1])
    banned = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(first): -100},
        logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    assert banned.choices[0].logprobs.tokens[0] != f"token_id:{first}"
    allowed = [9707, 1879, 11]
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=2, logprobs=0,
        extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True,
                    "ignore_eos": True})
    assert {int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens} <= set(allowed)
    # bad_words bans tokens, not text (the tilted demo may spell the same text otherwise):
    # a one-token word, the first token greedy decoding writes, never appears.
    from vllm.model_executor.model_loader.demos import resolve_model_dir
    from vllm.transformers_utils.tokenizer import get_tokenizer

    word = get_tokenizer(resolve_model_dir(MODEL)).decode([first])
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
        extra_body={"bad_words": [word], "return_tokens_as_token_ids": True})
    assert f"token_id:{first}" not in out.choices[0].logprobs.tokens


def test_openai_fields_with_nothing_to_do_here_are_accepted(client):
    """Every field of OpenAI's chat request that cannot change the reply here is accepted
    (code written for OpenAI's API runs unchanged), and the reply is the plain one."""
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                           temperature=0)
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, metadata={"k": "v"},
        store=False, service_tier="auto", prompt_cache_key="p", safety_identifier="u1",
        verbosity="low", reasoning_effort="low", modalities=["text"], user="someone")
    assert out.choices[0].message.content == plain.choices[0].message.content


def test_prompt_logprobs_and_echo_scores(client):
    """prompt_logprobs (upstream's field) scores every prompt token after the first; echo
    with logprobs returns the same scores in the legacy lists, streamed or not."""
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 1})
    scores = out.choices[0].model_extra["prompt_logprobs"]
    assert scores[0] is None and len(scores) > 3
    assert all(1 <= len(entry) <= 2 for entry in scores[1:])
    assert all(v["rank"] >= 1 and v["logprob"] <= 0 for e in scores[1:] for v in e.values())
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                     echo=True, logprobs=1)
    lp = echo.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(scores) + 2
    tokens = [int(t) for t in ({k for e in scores[1:] for k in e})]
    assert tokens  # prompt scores name real token ids
    for j, entry in enumerate(scores[1:], start=1):
        best = max(entry.values(), key=lambda v: v["logprob"])
        assert lp.token_logprobs[j] <= 0
        assert max(lp.top_logprobs[j].values()) == pytest.approx(best["logprob"], abs=1e-5)
    assert echo.choices[0].text.startswith(PROMPT)
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                         temperature=0, echo=True, logprobs=1, stream=True)
    tokens_streamed = [t for chunk in streamed for c in chunk.choices if c.logprobs
                       for t in c.logprobs.tokens]
    assert tokens_streamed == lp.tokens
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None


# ---------------------------------------------------------------------- upstream's request fields


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json={"model": MODEL, **body}, timeout=120)


def _stream_chunks(server, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streaming request (the closing [DONE] left out)."""
    chunks = []
    with httpx.stream("POST", server.url(path), json={"model": MODEL, "stream": True, **body},
                      timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_return_token_ids(server, endpoint):
    if endpoint == "completions":
        path, body = "/v1/completions", {"prompt": PROMPT}
        rendered = {"prompt": PROMPT, "add_special_tokens": False}
    else:
        path, body = "/v1/chat/completions", {"messages": MESSAGES}
        rendered = {"messages": MESSAGES}
    body.update(max_tokens=12, temperature=0, ignore_eos=True, return_token_ids=True)
    reply = _post(server, path, body).json()
    choice = reply["choices"][0]
    text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
    prompt_ids = (choice if endpoint == "completions" else reply)["prompt_token_ids"]
    assert len(choice["token_ids"]) == reply["usage"]["completion_tokens"] == 12
    # The ids are what was generated and what was prompted.
    back = _post(server, "/detokenize", {"tokens": choice["token_ids"]}).json()["prompt"]
    assert back == text
    assert prompt_ids == _post(server, "/tokenize", rendered).json()["tokens"]
    # Streamed: each chunk's new ids, which add up to the same; the prompt's once, first.
    chunks = _stream_chunks(server, path, body)
    streamed = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids") or []]
    assert streamed == choice["token_ids"]
    holders = [c if endpoint == "chat" else c["choices"][0] for c in chunks if c["choices"]]
    with_prompt = [h["prompt_token_ids"] for h in holders if h.get("prompt_token_ids")]
    assert with_prompt == [prompt_ids] and holders[0].get("prompt_token_ids") == prompt_ids
    # Without the field, no ids.
    plain = _post(server, path, {**body, "return_token_ids": False}).json()
    assert plain["choices"][0].get("token_ids") is None


def test_cache_salt_separates_prefix_cache_hits(server):
    prompt = "Salted prefix caching keeps tenants apart. " * 12  # several KV blocks

    def cached(**extra) -> int:
        reply = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, **extra})
        assert reply.status_code == 200, reply.text
        details = reply.json()["usage"].get("prompt_tokens_details") or {}
        return details.get("cached_tokens", 0)

    assert cached() == 0
    assert cached(cache_salt="tenant-a") == 0  # a salt never shares with no salt
    assert cached(cache_salt="tenant-b") == 0
    assert cached(cache_salt="tenant-a") > 0
    assert cached() > 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value, param", [
    ("cache_salt", "", "cache_salt"),
    # This server schedules first come first served: a priority would be ignored.
    ("priority", 3, "priority"),
    ("priority", "high", "priority"),
    ("repetition_detection", {"max_pattern_size": 4, "min_count": 1},
     "repetition_detection.min_count"),
    ("repetition_detection", {"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2},
     "repetition_detection.min_pattern_size"),
    ("repetition_detection", {"max_pattern_size": 70000, "min_count": 2},
     "repetition_detection.max_pattern_size"),
    ("repetition_detection", {"max_pattern": 4}, "repetition_detection.max_pattern"),
])
def test_bad_upstream_fields_are_a_400_naming_the_field(server, path, field, value, param):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    reply = _post(server, path, {**body, "max_tokens": 2, field: value})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_repetition_detection_stops_a_loop(server, endpoint):
    # Greedy decoding of the random demo model loops within a few tokens.
    if endpoint == "completions":
        path, body = "/v1/completions", {"prompt": PROMPT}
    else:
        path, body = "/v1/chat/completions", {"messages": MESSAGES}
    body.update(max_tokens=40, temperature=0, ignore_eos=True, return_token_ids=True,
                priority=0)
    looped = _post(server, path, body).json()["choices"][0]
    assert looped["finish_reason"] == "length" and len(looped["token_ids"]) == 40
    detect = {"max_pattern_size": 4, "min_count": 4}
    stopped = _post(server, path, {**body, "repetition_detection": detect}).json()["choices"][0]
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", "repetition_detected")
    ids = stopped["token_ids"]
    assert len(ids) < 40 and ids == looped["token_ids"][:len(ids)]
    # The tail really repeats: some pattern of 1 to 4 tokens, 4 times in a row.
    assert any(len(ids) >= 4 * n and ids[-4 * n:] == ids[-n:] * 4 for n in range(1, 5))
