"""Reasoning and tool calling through the chat API (`--reasoning-parser qwen3
--enable-auto-tool-choice --tool-call-parser hermes`), with and without async scheduling, on
demo-think: a scripted model that thinks `OK, the user wants an answer.`, writes a blank line
and `<tool_call>`, then tokens at random. A JSON schema or a tool call constrains only the
answer after `</think>`; every answer that stops and every tool call's arguments are checked
with jsonschema, and async replies must equal sync ones. A third server drafts the grammar's
forced tokens (fast-forward, canonical mode): tool arguments stay valid, thoughts untouched."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
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
    common = ("demo-think", "--max-model-len", "1024", "--reasoning-parser", "qwen3",
              "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    return {
        "sync": start_server(*common, "--no-async-scheduling"),
        "async": start_server(*common, "--async-scheduling"),
    }


def chat(server, **kwargs):
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("max_tokens", 300)
    return server.client().chat.completions.create(model="demo-think", **kwargs)


def streamed(server, **kwargs):
    """(reasoning, content, finish_reason) of a streamed reply, deltas concatenated."""
    reasoning, content, _, finish = streamed_calls(server, **kwargs)
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


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_thinking_token_budget_ends_the_thought_and_the_answer_validates(servers, mode) -> None:
    thought = SCRIPT[SCRIPT.index("<think>") + 1:SCRIPT.index("</think>")]
    reply = chat(servers[mode], response_format=JSON_FORMAT, temperature=1.0, seed=3,
                 extra_body={"thinking_token_budget": 3})
    choice = reply.choices[0]
    assert choice.message.reasoning_content == "".join(thought[:3])
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    # The Responses API takes the same field.
    response = servers[mode].client().responses.create(
        model="demo-think", input="Answer with a digit.", max_output_tokens=40,
        temperature=0, extra_body={"thinking_token_budget": 2})
    reasoning = next(item for item in response.output if item.type == "reasoning")
    assert reasoning.content[0].text == "".join(thought[:2])


def test_negative_thinking_token_budget_is_a_400_naming_it(servers) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(servers["sync"], extra_body={"thinking_token_budget": -1})
    assert e.value.body["param"] == "thinking_token_budget"


# ---------------------------------------------------------------------- tools

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                   "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Lima"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SCHEMAS = {"add": ADD, "get_weather": WEATHER}


def tools(strict: bool = True) -> list[dict]:
    return [{"type": "function", "function": {"name": name, "description": name,
                                              "parameters": schema, "strict": strict}}
            for name, schema in SCHEMAS.items()]


CHOICES = {
    "required": "required",
    "named": {"type": "function", "function": {"name": "get_weather"}},
    "auto": "auto",
}
SAMPLINGS = [{"temperature": 0}, {"temperature": 1.0, "seed": 21}]


def call_pairs(message, finish_reason: str = "tool_calls") -> list[tuple[str, object]]:
    """(name, arguments) of each tool call, each validated against its function's schema;
    when the reply was cut off (finish "length") the last call's arguments may be too, and
    stay text."""
    pairs = []
    calls = message.tool_calls or []
    for i, call in enumerate(calls):
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        if finish_reason == "length" and i == len(calls) - 1:
            try:
                args = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                pairs.append((call.function.name, call.function.arguments))
                continue
        else:
            args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        pairs.append((call.function.name, args))
    return pairs


def streamed_calls(server, **kwargs):
    """(reasoning, content, [(name, arguments)], finish_reason) from a stream's deltas."""
    reasoning = content = ""
    calls: dict[int, list] = {}
    finish = None
    for chunk in chat(server, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, [None, ""])
                if tc.function.name:
                    entry[0] = tc.function.name
                entry[1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    pairs = []
    for i in sorted(calls):
        name, args = calls[i]
        try:
            pairs.append((name, json.loads(args)))
        except json.JSONDecodeError:  # the last call of a reply cut off
            assert finish == "length" and i == max(calls)
            pairs.append((name, args))
    return reasoning, content, pairs, finish


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_forced_tool_calls_validate(servers, mode, choice, sampling) -> None:
    # One call at most: a model that always writes the lowest allowed token never closes an
    # array of calls.
    reply = chat(servers[mode], tools=tools(strict=False), tool_choice=CHOICES[choice],
                 parallel_tool_calls=False, **sampling)
    c = reply.choices[0]
    assert c.message.reasoning_content == THOUGHT
    assert c.message.model_extra["reasoning"] == THOUGHT  # the name upstream now uses
    pairs = call_pairs(c.message)
    # As upstream answers a forced call: an empty string, not null.
    assert pairs and c.finish_reason == "tool_calls" and c.message.content == ""
    if choice == "named":
        assert [name for name, _ in pairs] == ["get_weather"]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_auto_with_strict_tools_calls_validly_and_leaves_text_free(servers, mode, sampling):
    reply = chat(servers[mode], tools=tools(strict=True), tool_choice="auto", max_tokens=150,
                 **sampling)
    c = reply.choices[0]
    assert c.message.reasoning_content == THOUGHT
    assert len(call_pairs(c.message)) >= 1
    # The text before the call is the model's own; after it the model writes freely.
    assert c.message.content is None or "<tool_call>" not in c.message.content[:3]


def test_parallel_required_calls_cut_off_keep_the_complete_ones(servers) -> None:
    reply = chat(servers["async"], tools=tools(), tool_choice="required", temperature=0,
                 max_tokens=120)
    c = reply.choices[0]
    pairs = call_pairs(c.message, c.finish_reason)
    assert c.finish_reason == "length" and len(pairs) >= 2
    assert all(isinstance(args, dict) for _, args in pairs[:-1])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_without_parallel_calls_stops_after_one(servers, stream) -> None:
    kwargs = dict(tools=tools(strict=True), tool_choice="auto", parallel_tool_calls=False,
                  temperature=0, max_tokens=150)
    if stream:
        _, _, pairs, finish = streamed_calls(servers["async"], **kwargs)
    else:
        c = chat(servers["async"], **kwargs).choices[0]
        pairs, finish = call_pairs(c.message), c.finish_reason
    assert len(pairs) == 1 and finish == "tool_calls"
    jsonschema.validate(pairs[0][1], SCHEMAS[pairs[0][0]])


def test_auto_without_strict_tools_does_not_invent_calls(servers) -> None:
    reply = chat(servers["sync"], tools=tools(strict=False), temperature=0, max_tokens=30)
    message = reply.choices[0].message
    # No call: no tool_calls at all (as OpenAI answers), not an empty list.
    assert message.tool_calls is None and message.content.startswith("\n\n<tool_call>")


def test_tool_choice_none_writes_text(servers) -> None:
    reply = chat(servers["sync"], tools=tools(), tool_choice="none", temperature=0,
                 max_tokens=20)
    message = reply.choices[0].message
    assert message.tool_calls is None and message.content.startswith("\n\n<tool_call>")


def test_a_reply_cut_off_before_its_call_is_named_has_no_tool_calls(servers) -> None:
    # The reply ends at `<tool_call>` (max_tokens): a call begun, none named.
    max_tokens = len(SCRIPT) - SCRIPT.index("<think>")
    body = {"model": "demo-think", "messages": MESSAGES, "tools": tools(strict=True),
            "temperature": 0, "max_tokens": max_tokens}
    reply = httpx.post(servers["sync"].url("/v1/chat/completions"), json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "length", choice
    assert choice["message"]["content"].endswith("<tool_call>"), choice
    assert "tool_calls" not in choice["message"], choice


@pytest.mark.parametrize("choice", sorted(CHOICES))
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_async_equals_sync_and_streams_equal_replies(servers, choice, sampling) -> None:
    kwargs = dict(tools=tools(strict=True), tool_choice=CHOICES[choice], max_tokens=150,
                  **sampling)
    results = {}
    for mode, server in servers.items():
        m = chat(server, **kwargs).choices[0]
        full = (m.message.reasoning_content, m.message.content,
                call_pairs(m.message, m.finish_reason), m.finish_reason)
        reasoning, content, pairs, finish = streamed_calls(server, **kwargs)
        assert (reasoning, pairs, finish) == (full[0], full[2], full[3])
        assert (content or None) == (full[1] or None) or content.strip() == (full[1] or "").strip()
        results[mode] = full
    assert results["sync"] == results["async"]


def test_tool_results_go_back_through_the_template(servers) -> None:
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call-1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "3"},
    ]
    bare = chat(servers["sync"], temperature=0, max_tokens=1)
    reply = chat(servers["sync"], messages=messages, tools=tools(), tool_choice="required",
                 temperature=0)
    assert reply.usage.prompt_tokens > bare.usage.prompt_tokens + 20
    assert call_pairs(reply.choices[0].message)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 5}}}}}]},
         "tools[0].function.parameters"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": tools(), "tool_choice": "required", "response_format": JSON_FORMAT},
         "tool_choice"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(servers, kwargs, param) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        chat(servers["sync"], **kwargs)
    assert e.value.body["param"] == param, e.value.body


# ------------------------------------------------------- tools with grammar fast-forward


@pytest.fixture(scope="module")
def canonical_server(start_server):
    """Async, with forced tokens drafted in canonical mode (the mode that changes the most),
    and every tool call strict by the server's policy."""
    return start_server("demo-think", "--max-model-len", "1024", "--reasoning-parser", "qwen3",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--async-scheduling",
                        "--structured-outputs-config.fast_forward", "canonical",
                        "--tool-call-strict", "parameter")


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_fast_forward_keeps_strict_tool_arguments_valid(canonical_server, choice, sampling):
    before = canonical_server.metrics().get("vllm:fast_forward_forced_tokens_total", 0.0)
    reply = chat(canonical_server, tools=tools(strict=True), tool_choice=CHOICES[choice],
                 parallel_tool_calls=False, **sampling)
    c = reply.choices[0]
    # Nothing is forced while thinking: the thought is the model's own, token for token.
    assert c.message.reasoning_content == THOUGHT
    pairs = call_pairs(c.message)
    assert pairs and c.finish_reason == "tool_calls"
    if choice == "named":
        assert [name for name, _ in pairs] == ["get_weather"]
    # The arguments' keys and punctuation are forced text: fast-forward did the writing.
    metrics = canonical_server.wait_idle()
    assert metrics["vllm:fast_forward_forced_tokens_total"] > before
    # Drafts are counted by position too (upstream's per-position counter): kept drafts at
    # position 0 are at least those at any later position.
    per_pos = [metrics[key] for i in range(64) if (key := (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total'
        f'{{model_name="demo-think",position="{i}"}}')) in metrics]
    assert per_pos and per_pos == sorted(per_pos, reverse=True), per_pos
    assert sum(per_pos) == metrics["vllm:spec_decode_num_accepted_tokens_total"]


def test_fast_forward_constrains_only_the_answer(canonical_server) -> None:
    reply = chat(canonical_server, response_format=JSON_FORMAT, temperature=1.0, seed=3)
    choice = reply.choices[0]
    assert choice.message.reasoning_content == THOUGHT
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_strict_policy_makes_calls_of_non_strict_open_tools_valid(canonical_server, sampling):
    """--tool-call-strict parameter: the client sends no `strict` and open schemas, and every
    call still names a requested tool and its arguments carry no unlisted property."""
    open_schemas = {name: {k: v for k, v in schema.items() if k != "additionalProperties"}
                    for name, schema in SCHEMAS.items()}
    sent = [{"type": "function", "function": {"name": name, "parameters": schema}}
            for name, schema in open_schemas.items()]
    reply = chat(canonical_server, tools=sent, tool_choice="auto", max_tokens=150, **sampling)
    c = reply.choices[0]
    assert c.message.tool_calls, c.message
    for call in c.message.tool_calls:
        # call_pairs validates against the closed schemas.
        assert call.function.name in open_schemas
    assert call_pairs(c.message, c.finish_reason)
