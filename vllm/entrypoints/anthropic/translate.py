"""From Anthropic's Messages API to the chat-completions path and back.

A Messages request becomes a ChatCompletionRequest (`to_chat_request`): `system` a system
message, content blocks chat messages (text joined, `tool_use` blocks an assistant's
`tool_calls`, `tool_result` blocks `tool` messages), `tools` functions, `tool_choice` the chat
tool_choice, `stop_sequences` stop strings, `max_tokens` max_completion_tokens,
`thinking.budget_tokens` thinking_token_budget. A final assistant turn is continued, as
Anthropic continues a prefilled answer. Errors the chat path raises name chat fields;
`anthropic_param` gives the Anthropic field instead. On the way back, `stop_reason` maps a
finish reason and `tool_input` a call's arguments.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pydantic

from vllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.exceptions import InvalidRequestError

# What each refused content block would need.
_UNSUPPORTED_BLOCKS = {
    "image": "image blocks are not supported on /v1/messages (a vision-language model takes "
             "images as image_url parts on /v1/chat/completions)",
    "document": "document blocks are not supported: no document model is loaded",
    "search_result": "search_result blocks are not supported",
    "container_upload": "container_upload blocks are not supported",
}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


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
                   where: str) -> list[dict[str, Any]]:
    """The chat messages of one Anthropic turn, in the order its blocks come."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []

    def flush() -> None:
        if texts or calls:
            message: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
            if calls:
                message["tool_calls"] = list(calls)
            out.append(message)
            texts.clear()
            calls.clear()

    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(block, dict):
            raise InvalidRequestError(at, "must be a content block object")
        kind = block.get("type")
        if kind == "text":
            if calls:  # text after a call starts the next message, keeping the order
                flush()
            texts.append(_text(block, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            flush()
            out.append(_tool_result(block, at))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier thinking is not shown to the model again, as chat templates do
        elif kind in ("tool_use", "tool_result", "thinking", "redacted_thinking"):
            raise InvalidRequestError(f"{at}.type", f"{kind!r} blocks belong in "
                                      f"{'user' if kind == 'tool_result' else 'assistant'} turns")
        else:
            _refuse_unsupported(kind, at)
    flush()
    return out


def chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """The chat messages of `system` and `messages`. Raises InvalidRequestError naming the
    message or block that cannot be one."""
    if not request.messages:
        raise InvalidRequestError("messages", "must hold at least one message")
    out: list[dict[str, Any]] = []
    system = request.system
    if isinstance(system, list):
        system = "\n".join(block.text for block in system)
    if system:
        out.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        out += _turn_messages(message.role, message.content, f"messages[{i}]")
    return out


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


def to_chat_request(request: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that serves `request` (a count_tokens request renders the same
    prompt). Raises InvalidRequestError naming the Anthropic field that cannot be served."""
    messages = chat_messages(request)
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
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in chat.items() if v is not None})
    except pydantic.ValidationError as e:
        first = e.errors(include_input=False, include_url=False)[0]
        loc = ".".join(map(str, first.get("loc", ())))
        raise InvalidRequestError(anthropic_param(loc) or "messages", first["msg"]) from None


def anthropic_param(param: str | None) -> str | None:
    """The Anthropic name of a chat request's field (`max_completion_tokens` ->
    `max_tokens`, `tools[0].function.parameters` -> `tools[0].input_schema`); chat message
    indexes do not match Anthropic's, so a message error names `messages`."""
    if param is None:
        return None
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
