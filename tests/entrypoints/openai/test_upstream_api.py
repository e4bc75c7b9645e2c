"""Upstream vLLM's API surfaces beyond chat and completions, against one real server
(demo-think with Qwen3's reasoning parser loaded by `--reasoning-parser-plugin`, tool calling
and an API key): the metric names upstream's dashboards read, /tokenize and /detokenize, and
/v1/responses."""

from __future__ import annotations

import re

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
    # The latency histograms of upstream's dashboards: one observation per request (TPOT too,
    # since every request below produces more than one token).
    "vllm:time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
)
# Upstream vLLM V1's metrics (its "Production Metrics" list) as (name, type, the labels
# each sample carries beside model_name and engine); histograms are named without
# _bucket/_sum/_count, counters with _total.
UPSTREAM_V1_METRICS = [
    ("vllm:num_requests_running", "gauge", ()),
    ("vllm:num_requests_waiting", "gauge", ()),
    ("vllm:kv_cache_usage_perc", "gauge", ()),
    ("vllm:cache_config_info", "gauge", ("block_size", "cache_dtype", "enable_prefix_caching",
                                         "gpu_memory_utilization", "num_gpu_blocks")),
    ("vllm:prefix_cache_queries_total", "counter", ()),
    ("vllm:prefix_cache_hits_total", "counter", ()),
    ("vllm:num_preemptions_total", "counter", ()),
    ("vllm:prompt_tokens_total", "counter", ()),
    ("vllm:generation_tokens_total", "counter", ()),
    ("vllm:request_success_total", "counter", ("finished_reason",)),
    ("vllm:spec_decode_num_drafts_total", "counter", ()),
    ("vllm:spec_decode_num_draft_tokens_total", "counter", ()),
    ("vllm:spec_decode_num_accepted_tokens_total", "counter", ()),
    ("vllm:iteration_tokens_total", "histogram", ()),
    ("vllm:request_prompt_tokens", "histogram", ()),
    ("vllm:request_generation_tokens", "histogram", ()),
    ("vllm:request_params_n", "histogram", ()),
    ("vllm:request_params_max_tokens", "histogram", ()),
    ("vllm:time_to_first_token_seconds", "histogram", ()),
    ("vllm:time_per_output_token_seconds", "histogram", ()),
    ("vllm:request_time_per_output_token_seconds", "histogram", ()),
    ("vllm:inter_token_latency_seconds", "histogram", ()),
    ("vllm:e2e_request_latency_seconds", "histogram", ()),
    ("vllm:request_queue_time_seconds", "histogram", ()),
    ("vllm:request_inference_time_seconds", "histogram", ()),
    ("vllm:request_prefill_time_seconds", "histogram", ()),
    ("vllm:request_decode_time_seconds", "histogram", ()),
]


# The server's reasoning parser comes from a plugin file (--reasoning-parser-plugin): Qwen3's
# rules under a name of its own, so every reasoning test below runs the plugin's parser. It
# says which processes built it.
PLUGIN = """
import os

from vllm.reasoning import ReasoningParserManager
from vllm.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser


@ReasoningParserManager.register_module("qwen3_from_plugin")
class PluginParser(Qwen3ReasoningParser):
    def __init__(self, tokenizer, *ids):
        super().__init__(tokenizer, *ids)
        print(f"plugin parser built in pid {os.getpid()}", flush=True)
"""


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    plugin = tmp_path_factory.mktemp("plugin") / "think_plugin.py"
    plugin.write_text(PLUGIN)
    return start_server(MODEL, "--max-model-len", "1024",
                        "--reasoning-parser", "qwen3_from_plugin",
                        "--reasoning-parser-plugin", str(plugin),
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        api_key=API_KEY)


def test_the_plugin_parser_runs_in_the_server_and_the_engine_core(server) -> None:
    built = {int(pid) for pid in re.findall(r"plugin parser built in pid (\d+)", server.log())}
    assert built == {server.proc.pid, server.engine_pid}


def test_upstream_request_histograms_count_every_request(server) -> None:
    before = server.wait_idle()
    client = server.client()
    num_requests, produced, prompt_tokens = 3, 0, 0
    for i in range(num_requests):
        reply = client.completions.create(model=MODEL, prompt=f"Count {i}", max_tokens=5 + i,
                                          temperature=0, extra_body={"ignore_eos": True})
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
    assert produced == sum(5 + i for i in range(num_requests))
    # Upstream's request-parameter and step histograms, and the finish reasons.
    assert delta("vllm:request_params_max_tokens_count") == num_requests
    assert delta("vllm:request_params_max_tokens_sum") == produced  # ignore_eos: all used
    assert delta("vllm:request_params_n_sum") == num_requests
    assert delta("vllm:request_inference_time_seconds_count") == num_requests
    assert delta("vllm:iteration_tokens_total_sum") == prompt_tokens + produced
    assert delta("vllm:iteration_tokens_total_count") >= max(5 + i for i in range(num_requests))
    length = 'vllm:request_success_total{finished_reason="length",model_name="demo-think"}'
    assert delta(length) == num_requests


def test_metrics_carry_upstream_v1_names_types_and_labels(server) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    client = server.client()
    client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    server.wait_idle()
    samples: dict[str, tuple[str, list[dict[str, str]]]] = {}
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            entry = samples.setdefault(sample.name, (family.type, []))
            entry[1].append({k: v for k, v in sample.labels.items() if k != "le"})
    for name, kind, extra in UPSTREAM_V1_METRICS:
        sample_name = f"{name}_count" if kind == "histogram" else name
        assert sample_name in samples, name
        got_kind, label_sets = samples[sample_name]
        assert got_kind == kind, name
        for labels in label_sets:
            assert labels["model_name"] == MODEL and labels["engine"] == "0", (name, labels)
            assert set(extra) <= set(labels) - {"model_name", "engine"}, (name, labels)
            if name != "vllm:cache_config_info":
                assert set(labels) == {"model_name", "engine", *extra}, (name, labels)


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


def test_detokenize_takes_at_most_a_context_of_ids_and_an_empty_model_is_unknown(
        server) -> None:
    too_many = post(server, "/detokenize", {"model": MODEL, "tokens": [1] * 1025})
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "tokens"
    assert "1024" in too_many.json()["error"]["message"]
    assert post(server, "/detokenize", {"model": MODEL, "tokens": [1] * 1024}).status_code == 200
    assert post(server, "/detokenize", {"model": "", "tokens": [1]}).status_code == 404


def test_tokenize_takes_at_most_32_characters_per_token_of_context(server) -> None:
    limit = 1024 * 32  # --max-model-len 1024
    assert post(server, "/tokenize", {"model": MODEL, "prompt": "a" * limit}).status_code == 200
    too_long = post(server, "/tokenize", {"model": MODEL, "prompt": "a" * (limit + 1)})
    assert too_long.status_code == 400, too_long.text
    error = too_long.json()["error"]
    assert error["param"] == "prompt" and str(limit) in error["message"]
    assert "max_model_len 1024" in error["message"]
    # A conversation is measured as rendered, template included.
    chat = post(server, "/tokenize", {"model": MODEL, "messages": [
        {"role": "user", "content": "a" * limit}]})
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["param"] == "messages"
    assert str(limit) in chat.json()["error"]["message"]


@pytest.mark.parametrize(("bad_words", "limit"), [
    (["w"] * 129, "128"),           # too many words
    (["w" * 1025], "1024"),         # a word too long
])
def test_bad_words_sizes_are_bounded(server, bad_words, limit) -> None:
    reply = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1,
                                             "bad_words": bad_words})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "bad_words" and limit in error["message"]


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


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9},
                   "word": {"type": "string", "maxLength": 8}},
    "required": ["answer", "word"],
    "additionalProperties": False,
}


def test_responses_json_schema_validates_and_reasoning_is_an_item(server) -> None:
    import jsonschema

    client = server.client()
    for seed in (1, 2, 3):
        response = client.responses.create(
            model=MODEL,
            instructions="Answer in JSON.",
            input=[{"role": "user", "content": "Give a digit and a word."}],
            max_output_tokens=300,
            temperature=1.0,
            extra_body={"seed": seed},
            text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA,
                             "strict": True}},
        )
        assert response.object == "response"
        assert response.status == "completed", response
        kinds = [item.type for item in response.output]
        assert kinds == ["reasoning", "message"]
        assert "OK" in response.output[0].content[0].text
        jsonschema.validate(__import__("json").loads(response.output_text), SCHEMA)
        assert response.usage.output_tokens > response.usage.output_tokens_details.reasoning_tokens > 0
        assert response.text.format.type == "json_schema"


def test_responses_text_input_and_max_output_tokens(server) -> None:
    response = server.client().responses.create(model=MODEL, input="Hi", max_output_tokens=3,
                                                temperature=0)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_responses_json_object(server) -> None:
    import json

    response = server.client().responses.create(
        model=MODEL, input="JSON please", max_output_tokens=400, temperature=0,
        text={"format": {"type": "json_object"}},
    )
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)


def test_responses_forced_function_call(server) -> None:
    import json

    import jsonschema

    params = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}},
              "required": ["city"], "additionalProperties": False}
    response = server.client().responses.create(
        model=MODEL, input="Weather?", max_output_tokens=300, temperature=0,
        tools=[{"type": "function", "name": "weather", "parameters": params, "strict": True}],
        tool_choice={"type": "function", "name": "weather"},
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "weather"
    jsonschema.validate(json.loads(calls[0].arguments), params)
    # The call goes back as input with its output, and the model answers again.
    follow = server.client().responses.create(
        model=MODEL, max_output_tokens=5, temperature=0,
        input=[{"role": "user", "content": "Weather?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "sunny"}],
    )
    assert follow.output


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}},
     "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                        "schema": {"type": "bogus"}}}}, "text.format.schema"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": [{"type": "image", "url": "u"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
     "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": ["hi"]}]}, "input[0].content[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     "tools[0].parameters"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({}, "input"),
])
def test_bad_responses_input_is_a_400_naming_the_field(server, body, param) -> None:
    reply = post(server, "/v1/responses", {"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


def test_responses_stream_events_add_up_to_the_response(server) -> None:
    import json

    import jsonschema

    stream = server.client().responses.create(
        model=MODEL, input="Give a digit and a word.", max_output_tokens=300, temperature=1.0,
        extra_body={"seed": 4}, stream=True,
        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response
    assert final.output_text == text
    assert "OK" in thinking and final.output[0].content[0].text == thinking
    jsonschema.validate(json.loads(text), SCHEMA)
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done == ["reasoning", "message"]


def test_responses_auto_tool_choice_streams_a_function_call_item(server) -> None:
    import json

    import jsonschema

    params = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    stream = server.client().responses.create(
        model=MODEL, input="Call it.", max_output_tokens=300, temperature=0, stream=True,
        tools=[{"type": "function", "name": "pick", "parameters": params, "strict": True}],
        parallel_tool_calls=False,  # the reply ends after its first (strict) call
    )
    events = list(stream)
    final = events[-1].response
    assert events[-1].type == "response.completed"
    calls = [item for item in final.output if item.type == "function_call"]
    # demo-think writes <tool_call> right after its thinking: a strict call follows.
    assert len(calls) == 1 and calls[0].name == "pick"
    jsonschema.validate(json.loads(calls[0].arguments), params)
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert args == [calls[0].arguments]
    assert final.tool_choice == "auto" and final.parallel_tool_calls is False


@pytest.mark.parametrize("tool_choice", ["auto", {"type": "function", "name": "pick"}])
def test_responses_stream_function_call_arguments_as_openai_does(server, tool_choice) -> None:
    """The openai client's own stream helper reassembles the streamed events (call item
    added, argument deltas, arguments done, item done) into the function call that the
    same request returns unstreamed."""
    params = {"type": "object", "properties": {"word": {"enum": ["alpha", "omega"]},
                                               "n": {"type": "integer", "minimum": 0}},
              "required": ["word", "n"], "additionalProperties": False}
    kwargs = dict(model=MODEL, input="Call it.", max_output_tokens=300, temperature=0,
                  tools=[{"type": "function", "name": "pick", "parameters": params,
                          "strict": True}],
                  tool_choice=tool_choice, parallel_tool_calls=False)
    client = server.client()
    whole = client.responses.create(**kwargs)
    want = [(i.name, i.arguments) for i in whole.output if i.type == "function_call"]
    assert len(want) == 1
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == want
    index = next(e.output_index for e in events if e.type == "response.output_item.added"
                 and e.item.type == "function_call")
    mine = [e.type for e in events if getattr(e, "output_index", None) == index]
    assert mine[0] == "response.output_item.added" and mine[-2:] == [
        "response.function_call_arguments.done", "response.output_item.done"]
    assert set(mine[1:-2]) == {"response.function_call_arguments.delta"}
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == want[0][1]
