"""Reasoning models through the chat API (`--reasoning-parser qwen3`), with and without async
scheduling, on demo-think: a scripted model that thinks `OK, the user wants an answer.`
and then writes tokens at random. A JSON schema constrains only the answer after
`</think>`; every answer that stops is checked with jsonschema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from vllm.model_executor.model_loader.demo_scripted import SCRIPT

THOUGHT = "".join(SCRIPT[SCRIPT.index("<think>") + 1:SCRIPT.index("</think>")])
MESSAGES = [{"role": "user", "content": "Answer with a digit."}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer"],
    "additionalProperties": False,
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def servers(start_server):
    common = ("demo-think", "--max-model-len", "512", "--reasoning-parser", "qwen3")
    return {
        "sync": start_server(*common),
        "async": start_server(*common, "--async-scheduling"),
    }


def chat(server, **kwargs):
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("max_tokens", 300)
    return server.client().chat.completions.create(model="demo-think", **kwargs)


def streamed(server, **kwargs):
    """(reasoning, content, finish_reason) of a streamed reply, deltas concatenated."""
    reasoning = content = ""
    finish = None
    for chunk in chat(server, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_thinking_is_reasoning_content_and_the_answer_is_free(servers, mode) -> None:
    reply = chat(servers[mode], temperature=0, max_tokens=20)
    message = reply.choices[0].message
    assert message.reasoning_content == THOUGHT
    assert message.content.startswith("\n\n<tool_call>")


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7},
                                      {"temperature": 1.0, "seed": 8}])
def test_schema_constrains_only_the_answer(servers, mode, sampling) -> None:
    reply = chat(servers[mode], response_format=JSON_FORMAT, **sampling)
    choice = reply.choices[0]
    assert choice.message.reasoning_content == THOUGHT
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}])
def test_async_equals_sync(servers, sampling) -> None:
    replies = {
        mode: chat(server, response_format=JSON_FORMAT, n=2, logprobs=True, **sampling)
        for mode, server in servers.items()
    }
    sync, asyn = ([(c.message.content, c.message.reasoning_content,
                    [t.logprob for t in c.logprobs.content]) for c in r.choices]
                  for r in (replies["sync"], replies["async"]))
    assert sync == asyn


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_stream_deltas_equal_the_full_reply(servers, mode) -> None:
    full = chat(servers[mode], response_format=JSON_FORMAT, temperature=1.0, seed=5)
    message = full.choices[0].message
    reasoning, content, finish = streamed(
        servers[mode], response_format=JSON_FORMAT, temperature=1.0, seed=5)
    assert (reasoning, content, finish) == (
        message.reasoning_content, message.content, full.choices[0].finish_reason)
    assert reasoning == THOUGHT


def test_enable_thinking_false_answers_at_once(servers) -> None:
    reply = chat(servers["async"], response_format=JSON_FORMAT, temperature=0,
                 extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    assert message.reasoning_content is None
    jsonschema.validate(json.loads(message.content), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_budget_hit_while_thinking(servers, stream) -> None:
    """max_tokens inside the thinking block: the partial thought, no content, "length"."""
    kwargs = {"response_format": JSON_FORMAT, "temperature": 0, "max_tokens": 4}
    if stream:
        reasoning, content, finish = streamed(servers["sync"], **kwargs)
    else:
        choice = chat(servers["sync"], **kwargs).choices[0]
        reasoning, content, finish = (
            choice.message.reasoning_content, choice.message.content, choice.finish_reason)
    assert reasoning == "".join(SCRIPT[2:5]) and not content and finish == "length"
