"""From Anthropic's Messages API to the chat-completions path and back.

A Messages request becomes a ChatCompletionRequest (`to_chat_request`): `system` a system
message, content blocks chat messages (text joined, `image` blocks `image_url` parts,
`tool_use` blocks an assistant's `tool_calls`, `tool_result` blocks `tool` messages),
`tools` functions, `tool_choice` the chat tool_choice, `stop_sequences` stop strings,
`max_tokens` max_completion_tokens, `thinking.budget_tokens` thinking_token_budget. A final
assistant turn is continued, as Anthropic continues a prefilled answer. Errors the chat path
raises name chat fields; `anthropic_param` gives the Anthropic field instead. On the way
back, `stop_reason` maps a finish reason and `tool_input` a call's arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pydantic
from pydantic import PrivateAttr

from vllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.exceptions import InvalidRequestError

# What each refused content block would need.
_UNSUPPORTED_BLOCKS = {
    "document": "document blocks are not supported: no document model is loaded",
    "search_result": "search_result blocks are not supported",
    "container_upload": "container_upload blocks are not supported",
}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# The turn each role-bound block belongs in.
_TURN_OF = {"tool_use": "assistant", "thinking": "assistant", "redacted_thinking": "assistant",
            "tool_result": "user", "image": "user"}
# The media types Anthropic takes for a base64 image.
_IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


class ChatForMessages(ChatCompletionRequest):
    """The chat request a Messages request becomes, with the Anthropic name of each chat
    content part that came from a block (`messages[k].content[j]` -> `messages[i].content[b]`),
    so that an image the chat path refuses is named as the client sent it."""

    _places: dict[str, str] = PrivateAttr(default_factory=dict)


def new_message_id() -> str:
    """A fresh message id, `msg_...`."""
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call_id: str) -> str:
    """The Anthropic id (`toolu_...`) of a tool call the chat path named `chatcmpl-tool-...`."""
    return "toolu_" + call_id.rsplit("-", 1)[-1]


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequestError(f"{where}.text", "a text block needs a string text")
    if block.get("citations"):
        raise InvalidRequestError(f"{where}.citations", "citations are not supported")
    return text


def _refuse_unsupported(kind: Any, where: str) -> None:
    """Raises InvalidRequestError naming a block this server cannot read."""
    if kind in _UNSUPPORTED_BLOCKS:
        raise InvalidRequestError(where, _UNSUPPORTED_BLOCKS[kind])
    raise InvalidRequestError(f"{where}.type", f"{kind!r} blocks are not supported here")


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """The chat image_url part of an image block (a base64 source as a data URL, a url
    source as it is; the chat path loads it under the server's media rules). Raises
    InvalidRequestError naming the source field that cannot be one."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise InvalidRequestError(f"{where}.source", "must be an object")
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in _IMAGE_MEDIA_TYPES:
            raise InvalidRequestError(f"{where}.source.media_type",
                                      f"must be one of {', '.join(_IMAGE_MEDIA_TYPES)}")
        if not isinstance(data, str) or not data:
            raise InvalidRequestError(f"{where}.source.data", "must be a non-empty string")
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise InvalidRequestError(f"{where}.source.url", "must be a non-empty string")
    elif kind == "file":
        raise InvalidRequestError(f"{where}.source.type", "'file' sources are not supported "
                                  "(no files are stored here): send base64 or url")
    else:
        raise InvalidRequestError(f"{where}.source.type", "must be 'base64' or 'url'")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    """The chat `tool` message of a tool_result block (an error result says so first)."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise InvalidRequestError(f"{where}.tool_use_id", "must be a string")
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            at = f"{where}.content[{k}]"
            if not isinstance(part, dict):
                raise InvalidRequestError(at, "must be a content block object")
            if part.get("type") == "image":
                raise InvalidRequestError(at, "images inside a tool_result are not supported "
                                          "(send them as image blocks of a user turn)")
            if part.get("type") != "text":
                _refuse_unsupported(part.get("type"), at)
            texts.append(_text(part, at))
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise InvalidRequestError(f"{where}.content", "must be a string or a list of blocks")
    # The chat format has no error flag on a tool message; the model reads it in the text.
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    """The chat `tool_calls` entry of a tool_use block."""
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise InvalidRequestError(where, "a tool_use block needs a string id and name")
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"{where}.input", "must be an object")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _turn_messages(role: str, content: str | list[dict[str, Any]],
                   where: str) -> list[tuple[dict[str, Any], list[str]]]:
    """The chat messages of one Anthropic turn, in the order its blocks come, each with
    the Anthropic name of every content part when its content is a list of parts (a
    message with images; one without is plain text, its text blocks joined by newlines)."""
    if isinstance(content, str):
        return [({"role": role, "content": content}, [])]
    out: list[tuple[dict[str, Any], list[str]]] = []
    parts: list[dict[str, Any]] = []
    names: list[str] = []
    calls: list[dict[str, Any]] = []

    def flush() -> None:
        if parts or calls:
            texts = [p["text"] for p in parts if p["type"] == "text"]
            if len(texts) == len(parts):  # each text after the first starts with "\n"
                message: dict[str, Any] = {"role": role, "content": "".join(texts)}
            else:
                message = {"role": role, "content": list(parts)}
            if calls:
                message["tool_calls"] = list(calls)
            out.append((message, list(names) if len(texts) < len(parts) else []))
            parts.clear()
            names.clear()
            calls.clear()

    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(block, dict):
            raise InvalidRequestError(at, "must be a content block object")
        kind = block.get("type")
        if kind == "text":
            if calls:  # text after a call starts the next message, keeping the order
                flush()
            # Newlines between text blocks, as a text-only message joins them.
            joined = "\n" if parts and parts[-1]["type"] == "text" else ""
            parts.append({"type": "text", "text": joined + _text(block, at)})
            names.append(at)
        elif kind == "image" and role == "user":
            parts.append(_image_part(block, at))
            names.append(at)
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            flush()
            out.append((_tool_result(block, at), []))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier thinking is not shown to the model again, as chat templates do
        elif kind in _TURN_OF:
            raise InvalidRequestError(f"{at}.type",
                                      f"{kind!r} blocks belong in {_TURN_OF[kind]} turns")
        else:
            _refuse_unsupported(kind, at)
    flush()
    return out


def chat_messages(request: CountTokensRequest) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The chat messages of `system` and `messages`, and the Anthropic name of each chat
    content part that came from a block. Raises InvalidRequestError naming the message or
    block that cannot be one."""
    if not request.messages:
        raise InvalidRequestError("messages", "must hold at least one message")
    out: list[dict[str, Any]] = []
    places: dict[str, str] = {}
    system = request.system
    if isinstance(system, list):
        system = "\n".join(block.text for block in system)
    if system:
        out.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        for chat_message, names in _turn_messages(message.role, message.content,
                                                  f"messages[{i}]"):
            for j, name in enumerate(names):
                places[f"messages[{len(out)}].content[{j}]"] = name
            out.append(chat_message)
    return out, places


def _tools(request: CountTokensRequest) -> list[dict[str, Any]] | None:
    """The chat tools of `tools`; a server tool or a tool without a name or schema is refused."""
    if request.tools is None:
        return None
    tools = []
    for i, tool in enumerate(request.tools):
        if tool.type not in (None, "custom"):
            raise InvalidRequestError(
                f"tools[{i}].type",
                f"{tool.type!r}: server tools are not supported (client tools only)")
        extra = sorted(set(tool.model_extra or {}))
        if extra:
            raise InvalidRequestError(f"tools[{i}].{extra[0]}", "is not a field of a tool")
        if not tool.name:
            raise InvalidRequestError(f"tools[{i}].name", "is required")
        if tool.input_schema is None:
            raise InvalidRequestError(f"tools[{i}].input_schema", "is required")
        function = {"name": tool.name, "description": tool.description,
                    "parameters": tool.input_schema, "strict": tool.strict}
        tools.append({"type": "function",
                      "function": {k: v for k, v in function.items() if v is not None}})
    return tools


def _tool_choice(request: CountTokensRequest) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls) of `tool_choice`."""
    choice = request.tool_choice
    if choice is None:
        return None, None
    parallel = None if choice.disable_parallel_tool_use is None \
        else not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequestError("tool_choice.name", 'is required with "type": "tool"')
        return {"type": "function", "function": {"name": choice.name}}, parallel
    if choice.name is not None:
        raise InvalidRequestError("tool_choice.name", 'is only allowed with "type": "tool"')
    return _TOOL_CHOICES[choice.type], parallel


def _thinking(request: CountTokensRequest) -> tuple[dict[str, Any] | None, int | None]:
    """(chat-template kwargs, thinking_token_budget) of `thinking`: enabled thinks at most
    `budget_tokens` tokens (the engine then ends the thinking block), disabled asks the chat
    template not to think."""
    thinking = request.thinking
    if thinking is None:
        return None, None
    if thinking.type == "disabled":
        if thinking.budget_tokens is not None:
            raise InvalidRequestError("thinking.budget_tokens",
                                      'is only allowed with "type": "enabled"')
        # The switch thinking chat templates (Qwen3's and others) read.
        return {"enable_thinking": False}, None
    if thinking.budget_tokens is None:
        raise InvalidRequestError("thinking.budget_tokens", 'is required with "type": "enabled"')
    return {"enable_thinking": True}, thinking.budget_tokens


def to_chat_request(request: CountTokensRequest) -> ChatForMessages:
    """The chat request that serves `request` (a count_tokens request renders the same
    prompt). Raises InvalidRequestError naming the Anthropic field that cannot be served."""
    messages, places = chat_messages(request)
    choice, parallel = _tool_choice(request)
    template_kwargs, budget = _thinking(request)
    chat: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "tools": _tools(request),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": template_kwargs,
    }
    last = messages[-1]
    if last["role"] == "assistant" and not last.get("tool_calls"):
        # A prefilled answer: the reply continues it rather than starting a new turn.
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    if isinstance(request, MessagesRequest):
        chat.update({
            "max_completion_tokens": request.max_tokens,
            "stop": request.stop_sequences,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "stream": request.stream,
            "request_id": new_message_id(),
            "thinking_token_budget": budget,
        })
    try:
        converted = ChatForMessages.model_validate(
            {k: v for k, v in chat.items() if v is not None})
    except pydantic.ValidationError as e:
        first = e.errors(include_input=False, include_url=False)[0]
        loc = ".".join(map(str, first.get("loc", ())))
        raise InvalidRequestError(anthropic_param(loc) or "messages", first["msg"]) from None
    converted._places = places
    return converted


def anthropic_param(param: str | None, places: dict[str, str] | None = None) -> str | None:
    """The Anthropic name of a chat request's field (`max_completion_tokens` ->
    `max_tokens`, `tools[0].function.parameters` -> `tools[0].input_schema`). A content
    part is named by `places` (ChatForMessages._places); other chat message indexes do not
    match Anthropic's, so another message error names `messages`."""
    if param is None:
        return None
    part = re.match(r"messages\[\d+\]\.content\[\d+\]", param)
    if part and places and part.group() in places:
        return places[part.group()] + param[part.end():]
    if param.startswith("messages"):
        return "messages"
    if param in ("max_tokens", "max_completion_tokens"):
        return "max_tokens"
    if param == "stop":
        return "stop_sequences"
    if param.startswith(("structured_outputs", "response_format")):
        return "tools"  # the only constraint a Messages request has comes from its tools
    if param.startswith("chat_template_kwargs"):
        return "thinking"
    if param == "thinking_token_budget":
        return "thinking.budget_tokens"
    if param.startswith("tool_choice.function"):
        return "tool_choice" + param[len("tool_choice.function"):]
    if param.startswith("tools[") and ".function.parameters" in param:
        return param.replace(".function.parameters", ".input_schema", 1)
    if param.startswith("tools[") and ".function" in param:
        return param.replace(".function", "", 1)
    return param


def stop_reason(finish_reason: str | None, matched: int | str | None,
                has_calls: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished reply: `max_tokens` when cut off,
    `tool_use` after a call, `stop_sequence` (with the string) when a stop sequence ended it,
    else `end_turn`. Nothing while the reply is unfinished."""
    if finish_reason is None:
        return None, None
    if finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """The `input` object of a call's arguments text. Arguments cut off by max_tokens give
    the object of their complete members (an object is cut only after its last whole
    member); arguments that hold no object give {}."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = _complete_prefix(arguments)
    return value if isinstance(value, dict) else {}


def _complete_prefix(text: str) -> Any:
    """The JSON value of the longest cut of `text` (a prefix of a JSON document) made where
    every member before it is whole, with its open objects and arrays closed; None when
    there is no such cut."""
    closers: list[str] = []
    in_string = escaped = False
    cut: tuple[int, str] | None = None
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            closers.append("}" if ch == "{" else "]")
            cut = (i + 1, "".join(reversed(closers)))
        elif ch in "}]":
            if not closers:
                return None
            closers.pop()
            if closers:
                cut = (i + 1, "".join(reversed(closers)))
        elif ch == "," and closers:
            cut = (i, "".join(reversed(closers)))
    if cut is None:
        return None
    try:
        return json.loads(text[:cut[0]] + cut[1])
    except json.JSONDecodeError:
        return None
