"""`vllm serve` of a tiny random Qwen2.5-VL written by the test: the official openai client
sends images (data URL, a file under --allowed-local-media-path, an http URL of
--allowed-media-domains served on loopback) with a JSON schema and gets valid objects, as
do regex, choice and forced tool calls on an image prompt; /tokenize counts an image's
placeholders; bad images, too many images, URLs the flags do not allow and unknown part
types are 400s naming messages[i].content[j], and the server keeps serving. /v1/responses
takes input_image parts under the same rules, its errors naming input[i].content[j]."""

from __future__ import annotations

import base64
import io
import json
import re
import threading
from http import server as http_server

import anthropic
import httpx
import jsonschema
import pytest
from PIL import Image

from tests.entrypoints.openai.test_errors import assert_error
from tests.utils_vl import SCHEMA, image, shared_vl_checkpoint

CHAT = "/v1/chat/completions"


def _png(picture: Image.Image) -> bytes:
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return out.getvalue()


def _data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def _message(*urls: str, text: str = "What color, and how many?") -> list[dict]:
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A directory with one PNG, served over http on loopback as well."""
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(_png(image(40, 56, 5)))

    class Handler(http_server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args) -> None:
            pass

    httpd = http_server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    thread.join(10)


@pytest.fixture(scope="module")
def server(start_server, media):
    return start_server(
        str(shared_vl_checkpoint()[0]), "--served-model-name", "tiny-vl", "--max-model-len", "512",
        "--kv-cache-memory", "64MiB", "--limit-mm-per-prompt", '{"image": 2}',
        "--allowed-local-media-path", str(media[0]), "--allowed-media-domains", "127.0.0.1",
        "--structured-outputs-config.disable_any_whitespace", "true",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--disable-log-requests",
    )


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers(), timeout=60) as c:
        yield c


def test_openai_client_image_with_json_schema(server, media) -> None:
    client = server.client()
    urls = [_data_url(_png(image(64, 48, 1))), (media[0] / "cat.png").as_uri(),
            f"{media[1]}/cat.png"]
    answers = []
    for url in urls:
        reply = client.chat.completions.create(
            model="tiny-vl", messages=_message(url), max_tokens=40, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "count", "schema": SCHEMA}},
        )
        answer = json.loads(reply.choices[0].message.content)
        jsonschema.validate(answer, SCHEMA)
        answers.append(reply.usage.prompt_tokens)
    # The file and the http URL are one image: the same placeholder count.
    assert answers[1] == answers[2]
    two = client.chat.completions.create(model="tiny-vl", messages=_message(urls[0], urls[1]),
                                         max_tokens=4, temperature=0)
    assert two.usage.prompt_tokens > answers[0]


REGEX = r"[a-z]{2,6} [0-9]"
CHOICES = ["red", "green", "blue"]
TOOL = {"type": "function", "function": {"name": "report", "parameters": SCHEMA}}


def test_regex_choice_and_tool_calls_with_an_image(server) -> None:
    """Under the server's async scheduling, every other kind of constraint holds on an
    image prompt: a regex, a choice, and tool calls forced by tool_choice (required and
    named) whose arguments validate against the tool's schema."""
    client = server.client()
    messages = _message(_data_url(_png(image(48, 64, 6))))
    kwargs = {"model": "tiny-vl", "messages": messages, "temperature": 0}
    regex = client.chat.completions.create(
        max_tokens=12, extra_body={"structured_outputs": {"regex": REGEX}}, **kwargs)
    assert re.fullmatch(REGEX, regex.choices[0].message.content), regex
    choice = client.chat.completions.create(
        max_tokens=4, extra_body={"structured_outputs": {"choice": CHOICES}}, **kwargs)
    assert choice.choices[0].message.content in CHOICES
    for tool_choice in ("required", {"type": "function", "function": {"name": "report"}}):
        reply = client.chat.completions.create(max_tokens=60, tools=[TOOL],
                                               tool_choice=tool_choice, **kwargs)
        calls = reply.choices[0].message.tool_calls
        assert calls and all(c.function.name == "report" for c in calls), reply
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_tokenize_counts_image_placeholders(http) -> None:
    url = _data_url(_png(image(64, 64, 3)))  # 16 x 16 patches: 64 placeholder tokens
    with_image = http.post("/tokenize", json={"model": "tiny-vl", "messages": _message(url)})
    without = http.post("/tokenize", json={"model": "tiny-vl", "messages": _message()})
    assert with_image.status_code == 200, with_image.text
    # <|vision_start|><|vision_end|> and 64 <|image_pad|>.
    assert with_image.json()["count"] - without.json()["count"] == 66


@pytest.mark.parametrize("part, param, message", [
    ({"type": "image_url", "image_url": {"url": _data_url(_png(image(32, 32, 4))[:200])}},
     "messages[0].content[1]", "cannot decode"),  # a truncated PNG
    ({"type": "image_url", "image_url": {"url": _data_url(b"<svg></svg>", "svg+xml")}},
     "messages[0].content[1]", "supported format"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}},
     "messages[0].content[1]", "base64"),
    ({"type": "image_url", "image_url": {"url": "ftp://example.com/a.png"}},
     "messages[0].content[1]", "data:, file: or http"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/hostname"}},
     "messages[0].content[1]", "outside --allowed-local-media-path"),
    ({"type": "image_url", "image_url": {"url": "http://localhost:9/cat.png"}},
     "messages[0].content[1]", "not allowed"),
    ({"type": "image_url", "image_url": {"url": "x", "detail": "high"}},
     "messages[0].content[1].image_url.detail", "only 'auto'"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
     "messages[0].content[1]", "not supported"),
])
def test_bad_parts_are_400s_naming_the_part(http, part, param, message) -> None:
    body = {"model": "tiny-vl", "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    error = assert_error(http.post(CHAT, json=body), 400, param)
    assert message in error["message"], error


def test_oversized_and_too_many_images_then_still_serving(http, media) -> None:
    huge = io.BytesIO()
    Image.new("1", (9000, 8000)).save(huge, format="PNG")  # 72 megapixels, a small file
    body = {"model": "tiny-vl", "max_tokens": 2, "messages": _message(_data_url(huge.getvalue()))}
    error = assert_error(http.post(CHAT, json=body), 400, "messages[0].content[1]")
    assert "over the limit" in error["message"]
    url = _data_url(_png(image(16, 16, 9)))
    body = {"model": "tiny-vl", "max_tokens": 2, "messages": _message(url, url, url)}
    error = assert_error(http.post(CHAT, json=body), 400, "messages[0].content[3]")
    assert "at most 2" in error["message"]
    ok = http.post(CHAT, json={"model": "tiny-vl", "max_tokens": 2,
                               "messages": _message(url, (media[0] / "cat.png").as_uri())})
    assert ok.status_code == 200, ok.text


def test_responses_input_image_with_json_schema(server, media) -> None:
    """/v1/responses input_image parts (a data URL, an allowed http URL) under a JSON
    schema give valid objects, and take the image's placeholders as chat does."""
    client = server.client()
    url = _data_url(_png(image(64, 48, 1)))
    fmt = {"format": {"type": "json_schema", "name": "count", "schema": SCHEMA}}
    tokens = []
    for image_url in (url, f"{media[1]}/cat.png", None):
        content = [{"type": "input_text", "text": "What color, and how many?"}]
        if image_url is not None:
            content.append({"type": "input_image", "image_url": image_url, "detail": "auto"})
        response = client.responses.create(
            model="tiny-vl", input=[{"role": "user", "content": content}],
            max_output_tokens=40, temperature=0, text=fmt)
        assert response.status == "completed", response
        jsonschema.validate(json.loads(response.output_text), SCHEMA)
        tokens.append(response.usage.input_tokens)
    chat = client.chat.completions.create(model="tiny-vl", messages=_message(url),
                                          max_tokens=1)
    assert tokens[0] == chat.usage.prompt_tokens
    assert tokens[2] < tokens[1] < tokens[0]  # 48 x 64 is 48 tokens; cat.png fewer


@pytest.mark.parametrize("part, param, message", [
    ({"type": "input_image", "image_url": _data_url(_png(image(32, 32, 4))[:200])},
     "input[1].content[1]", "cannot decode"),
    ({"type": "input_image", "image_url": "file:///etc/hostname"},
     "input[1].content[1]", "outside --allowed-local-media-path"),
    ({"type": "input_image", "file_id": "file-1"}, "input[1].content[1].file_id", "not stored"),
    ({"type": "input_image"}, "input[1].content[1].image_url", "non-empty string"),
    ({"type": "input_image", "image_url": "x", "detail": "low"},
     "input[1].content[1].detail", "only 'auto'"),
    ({"type": "input_image", "image_url": "x", "size": 3}, "input[1].content[1].size",
     "not a field"),
    ({"type": "input_file", "file_data": "x"}, "input[1].content[1].type", "input_image"),
])
def test_responses_bad_image_parts_are_400s_naming_the_part(http, part, param,
                                                            message) -> None:
    body = {"model": "tiny-vl", "max_output_tokens": 2, "instructions": "Be brief.",
            "input": [{"role": "user", "content": "Hello."},
                      {"role": "user", "content": [{"type": "input_text", "text": "hi"}, part]}]}
    error = assert_error(http.post("/v1/responses", json=body), 400, param)
    assert message in error["message"], error


def test_mm_processor_kwargs_per_request(http) -> None:
    """A request's mm_processor_kwargs size its images (chat, /tokenize, /v1/responses
    alike); a refused key is a 400 naming it."""
    url = _data_url(_png(image(64, 64, 3)))  # 16 x 16 patches: 64 placeholder tokens
    small = {"max_pixels": 1024}  # 32 x 32 pixels: 8 x 8 patches, 16 tokens
    body = {"model": "tiny-vl", "max_tokens": 1, "messages": _message(url)}
    counts = []
    for kwargs in (None, small):
        extra = {} if kwargs is None else {"mm_processor_kwargs": kwargs}
        chat = http.post(CHAT, json={**body, **extra})
        assert chat.status_code == 200, chat.text
        tokens = http.post("/tokenize", json={"model": "tiny-vl", "messages": _message(url),
                                              **extra})
        assert tokens.status_code == 200, tokens.text
        assert tokens.json()["count"] == chat.json()["usage"]["prompt_tokens"]
        counts.append(tokens.json()["count"])
    assert counts[0] - counts[1] == 64 - 16
    response = http.post("/v1/responses", json={
        "model": "tiny-vl", "max_output_tokens": 1, "mm_processor_kwargs": small,
        "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What color, and how many?"},
            {"type": "input_image", "image_url": url}]}]})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["input_tokens"] == counts[1]
    error = assert_error(http.post(CHAT, json={**body, "mm_processor_kwargs": {"fps": 2}}),
                         400, "mm_processor_kwargs.fps")
    assert "not supported" in error["message"]


def test_anthropic_messages_take_image_blocks(server, media) -> None:
    """Anthropic's Messages API through the official SDK: base64 and url image blocks
    count as the chat path's image parts, and a tool forced by tool_choice gives a tool_use
    whose input validates; a corrupt image is a 400 naming its block, and a url the flags
    do not allow names its block too."""
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0,
                                 timeout=60)
    png = _png(image(64, 48, 1))
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png).decode()}}
    question = {"type": "text", "text": "What color, and how many?"}
    counted = client.messages.count_tokens(
        model="tiny-vl", messages=[{"role": "user", "content": [question, block]}])
    chat = server.client().chat.completions.create(
        model="tiny-vl", messages=_message(_data_url(png)), max_tokens=1)
    assert counted.input_tokens == chat.usage.prompt_tokens
    by_url = {"type": "image", "source": {"type": "url", "url": f"{media[1]}/cat.png"}}
    reply = client.messages.create(
        model="tiny-vl", max_tokens=60, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [question, block, by_url]}],
        tools=[{"name": "report", "input_schema": SCHEMA}],
        tool_choice={"type": "tool", "name": "report"})
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert uses and all(u.name == "report" for u in uses), reply
    for use in uses:
        jsonschema.validate(use.input, SCHEMA)
    for bad, message in (
        ({**block, "source": {**block["source"], "data": base64.b64encode(png[:100]).decode()}},
         "cannot decode"),
        ({"type": "image", "source": {"type": "url", "url": "http://localhost:9/a.png"}},
         "not allowed"),
    ):
        with pytest.raises(anthropic.BadRequestError) as refused:
            # The system prompt is chat message 0: the image is chat's messages[1].content[1].
            client.messages.create(model="tiny-vl", max_tokens=2, system="Be brief.",
                                   messages=[{"role": "user", "content": [question, bad]}])
        error = refused.value.body["error"]
        assert "messages[0].content[1]" in error["message"] and message in error["message"], \
            error
        assert "messages[1]" not in error["message"]
