"""POST /v1/responses (OpenAI's Responses API), served through the chat path.

A Responses request is translated into a chat request (input items become messages,
`instructions` a system message, `text.format` a response_format, flat function tools
nested ones), so the chat template, the structured-output constraint, the reasoning split
and the tool plan are the chat endpoint's own; only the answer's shape differs. A field
the chat path rejects is reported under its Responses name (`text.format`, `input`,
`max_output_tokens`, `tools[i].parameters`).
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import AsyncIterator
from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import Response
from pydantic import PrivateAttr

from vllm.entrypoints.openai.errors import exception_error, finish_error
from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.protocol_responses import (
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from vllm.entrypoints.openai.responses_events import (
    ResponseEvents,
    call_item,
    item_id,
    message_item,
    reasoning_item,
)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.streaming import merge_streams
from vllm.entrypoints.openai.tools import ToolCall, ToolCallStream, parse_reply
from vllm.exceptions import InvalidRequestError
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, OutputKind, RequestOutput
from vllm.reasoning import ReasoningStream
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.async_llm import RequestStream

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# The fields of an input_image content part.
_IMAGE_FIELDS = frozenset({"type", "image_url", "file_id", "detail"})
# Fields the Responses API has that this engine does not implement, and why.
_REFUSED = (
    ("previous_response_id", "responses are not stored here: send the whole conversation "
                             "as input"),
    ("conversation", "conversations are not stored here: send the whole conversation as input"),
    ("background", "background responses are not supported"),
    ("prompt", "stored prompt templates are not supported"),
    ("max_tool_calls", "is not supported"),
    ("top_logprobs", "is not supported on /v1/responses"),
)


# The Responses field a structured-output error of the current request is reported under
# (the constraint is compiled after `prepare`, in add_requests, which sees no request).
_CONSTRAINT_PARAM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "responses_constraint_param", default=None
)


class ChatForResponses(ChatCompletionRequest):
    """The chat request a Responses request becomes, carrying the original for the answer."""

    _origin: ResponsesRequest | None = PrivateAttr(default=None)
    # The Responses name of each message (instructions, input[i]) for errors.
    _message_names: list[str] | None = PrivateAttr(default=None)


def _image_part(part: dict[str, Any], name: str) -> dict[str, Any]:
    """The chat image_url part of an input_image part (the chat path loads the image under
    the server's media rules). Raises InvalidRequestError naming the field for an unknown
    field, a file_id, a missing image_url or a detail other than auto."""
    unknown = sorted(set(part) - _IMAGE_FIELDS)
    if unknown:
        raise InvalidRequestError(f"{name}.{unknown[0]}",
                                  "is not a field of an input_image part")
    if part.get("file_id") is not None:
        raise InvalidRequestError(f"{name}.file_id", "files are not stored here: send the "
                                  "image as image_url (a data URL, or a URL the server allows)")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{name}.image_url", "must be a non-empty string (a data "
                                  "URL, or a file:// or http(s) URL the server allows)")
    if part.get("detail", "auto") not in (None, "auto"):
        raise InvalidRequestError(f"{name}.detail", "only 'auto' is supported (the model's "
                                  "processor sizes every image)")
    return {"type": "image_url", "image_url": {"url": url}}


def _message_content(content: list[Any], where: str) -> str | list[dict[str, Any]]:
    """A message's content parts as chat content: the joined text, or, when an image is
    among them, chat parts in the same order (so content[j] keeps its index in errors).
    Raises InvalidRequestError naming a part that is neither text nor input_image."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            parts.append(_image_part(part, f"{where}.content[{j}]"))
        elif kind not in _TEXT_PARTS:
            raise InvalidRequestError(
                f"{where}.content[{j}].type",
                "only text parts (input_text, output_text) and input_image parts are supported",
            )
        elif not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}.content[{j}].text", "must be a string")
        else:
            parts.append({"type": "text", "text": part["text"]})
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _input_messages(request: ResponsesRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """The chat messages of `instructions` and `input`, and the Responses name of each.
    Raises InvalidRequestError naming the input item (and part) that cannot be a message."""
    messages: list[dict[str, Any]] = []
    names: list[str] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
        names.append("instructions")
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        names.append("input")
        return messages, names
    for i, item in enumerate(request.input):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise InvalidRequestError(
                    f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {item.get('role')!r}"
                )
            content = item.get("content")
            if isinstance(content, list):
                content = _message_content(content, where)
            elif not isinstance(content, str):
                raise InvalidRequestError(f"{where}.content", "must be a string or a list of parts")
            messages.append({"role": role, "content": content})
            names.append(where)
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments")
            call_id = item.get("call_id")
            if not isinstance(name, str) or not isinstance(arguments, str) \
                    or not isinstance(call_id, str):
                raise InvalidRequestError(
                    where, "a function_call item needs string call_id, name and arguments"
                )
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": arguments}}
            # Consecutive calls are one assistant turn, as the model wrote them.
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") \
                    and not last.get("content"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                names.append(where)
        elif kind == "function_call_output":
            output, call_id = item.get("output"), item.get("call_id")
            if not isinstance(output, str) or not isinstance(call_id, str):
                raise InvalidRequestError(
                    where, "a function_call_output item needs string call_id and output"
                )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            names.append(where)
        elif kind == "reasoning":
            continue  # earlier thinking is not sent back to the model, as chat templates do
        else:
            raise InvalidRequestError(
                f"{where}.type",
                f"{kind!r} is not supported (message, function_call, function_call_output, "
                "reasoning)",
            )
    if not messages:
        raise InvalidRequestError("input", "must hold at least one message")
    return messages, names


def to_chat_request(request: ResponsesRequest) -> ChatForResponses:
    """The chat request that produces `request`'s answer. Raises InvalidRequestError naming
    the Responses field that cannot be served."""
    for name, why in _REFUSED:
        if getattr(request, name) not in (None, False):
            raise InvalidRequestError(name, why)
    messages, names = _input_messages(request)
    chat: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "seed": request.seed,
        "repetition_penalty": request.repetition_penalty,
        "thinking_token_budget": request.thinking_token_budget,
        "stream": request.stream,
        "request_id": request.request_id or item_id("resp"),
        "parallel_tool_calls": request.parallel_tool_calls,
        "mm_processor_kwargs": request.mm_processor_kwargs,
    }
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise InvalidRequestError("text.format.schema", "a JSON schema object is required")
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict,
                            "description": fmt.description},
        }
    elif fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    if request.tools:
        tools = []
        for i, tool in enumerate(request.tools):
            if tool.type != "function":
                raise InvalidRequestError(
                    f"tools[{i}].type", f"{tool.type!r} tools are not supported (function only)"
                )
            if not tool.name:
                raise InvalidRequestError(f"tools[{i}].name", "is required")
            function = {"name": tool.name, "description": tool.description,
                        "parameters": tool.parameters, "strict": tool.strict}
            tools.append({"type": "function",
                          "function": {k: v for k, v in function.items() if v is not None}})
        chat["tools"] = tools
    choice = request.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequestError(
                "tool_choice", 'must be "auto", "none", "required" or '
                '{"type": "function", "name": ...}'
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    chat["tool_choice"] = choice
    if request.reasoning is not None and request.reasoning.effort is not None:
        chat["reasoning_effort"] = request.reasoning.effort
    try:
        converted = ChatForResponses.model_validate(
            {k: v for k, v in chat.items() if v is not None}
        )
    except pydantic.ValidationError as e:
        first = e.errors(include_input=False, include_url=False)[0]
        loc = ".".join(map(str, first.get("loc", ())))
        raise InvalidRequestError(responses_param(loc) or "input", first["msg"]) from None
    converted._origin = request
    converted._message_names = names
    return converted


def responses_param(param: str | None) -> str | None:
    """The Responses name of a chat request's field (`response_format.json_schema` ->
    `text.format`, `tools[0].function.parameters` -> `tools[0].parameters`)."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"
    if param.startswith("response_format"):
        return "text.format"
    if param in ("max_tokens", "max_completion_tokens"):
        return "max_output_tokens"
    if param == "reasoning_effort":
        return "reasoning.effort"
    return re.sub(r"^tools\[(\d+)\]\.function", r"tools[\1]", param)


class OpenAIServingResponses(OpenAIServingChat):
    """Runs Responses requests through the chat path and answers with response objects."""

    id_prefix = "resp"

    def message_names(self, request: ChatCompletionRequest) -> list[str] | None:
        """Errors about a message or its parts name the Responses input item."""
        return request._message_names if isinstance(request, ChatForResponses) else None

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        """The HTTP response of one Responses request (errors in OpenAI's shape)."""
        try:
            chat_request = to_chat_request(request)
        except InvalidRequestError as e:
            return exception_error(e).response()

        fmt = request.text.format if request.text is not None else None
        constraint_param = (
            "text.format.schema" if fmt is not None and fmt.type == "json_schema" else
            "text.format" if fmt is not None and fmt.type == "json_object" else
            "tools" if request.tools else None
        )

        def prepare() -> tuple[list[Any], SamplingParams]:
            try:
                return self.prepare_chat(chat_request)
            except InvalidRequestError as e:
                param = responses_param(e.param)
                if constraint_param is not None and (param or "").startswith(
                        "structured_outputs"):
                    param = constraint_param
                raise type(e)(param, e.message) from None

        token = _CONSTRAINT_PARAM.set(constraint_param)
        try:
            return await self.serve(chat_request, raw_request, prepare)
        finally:
            _CONSTRAINT_PARAM.reset(token)

    async def add_requests(
        self,
        request_id: str,
        prompts: list[Any],
        params: SamplingParams,
        kind: OutputKind,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> list[RequestStream]:
        """The chat path's admission, with a rejected constraint reported under the
        Responses field that gave it."""
        try:
            return await super().add_requests(request_id, prompts, params, kind, lora_request,
                                              priority)
        except InvalidRequestError as e:
            where = _CONSTRAINT_PARAM.get()
            if where is None or not (e.param or "").startswith("structured_outputs"):
                raise
            raise type(e)(where, e.message) from None

    # ------------------------------------------------------------------ the answer

    def _base(self, request: ChatForResponses, request_id: str, created: int,
              model: str) -> ResponseObject:
        """The response object before its output: the request's settings echoed back."""
        origin = request._origin
        assert origin is not None
        text = {"format": {"type": "text"}}
        if origin.text is not None and origin.text.format is not None:
            text = {"format": origin.text.format.model_dump(by_alias=True, exclude_none=True)}
        return ResponseObject(
            id=request_id,
            created_at=created,
            model=model,
            status="in_progress",
            instructions=origin.instructions,
            max_output_tokens=origin.max_output_tokens,
            temperature=1.0 if origin.temperature is None else origin.temperature,
            top_p=1.0 if origin.top_p is None else origin.top_p,
            parallel_tool_calls=origin.parallel_tool_calls is not False,
            tool_choice=origin.tool_choice or ("auto" if origin.tools else "none"),
            tools=[t.model_dump(exclude_none=True) for t in origin.tools or []],
            text=text,
            reasoning=(origin.reasoning.model_dump() if origin.reasoning is not None
                       else None),
            metadata=origin.metadata,
            truncation=origin.truncation or "disabled",
            user=origin.user,
        )

    def _split(self, final: RequestOutput, c: CompletionOutput,
               request: ChatForResponses) -> tuple[str | None, str | None, list[ToolCall], int]:
        """(reasoning, answer text, tool calls, reasoning tokens) of a finished reply."""
        parser = self.reasoning_parser
        reasoning, content = None, c.text
        num_reasoning = 0
        if parser is not None:
            state = parser.resolve(parser.initial_state(final.prompt_token_ids), c.token_ids)
            reasoning, content = parser.split(state, c.text)
            if reasoning is not None:
                # The text splits at the first end token, so the thinking's tokens run up to
                # and including that one (later end tokens belong to the answer); all of
                # them when it never ends.
                ids = list(c.token_ids)
                num_reasoning = (ids.index(parser.end_id) + 1 if parser.end_id in ids
                                 else len(ids))
        calls: list[ToolCall] = []
        plan = self.tool_plan(request)
        if plan is not None:
            content, calls = parse_reply(plan, content)
        return reasoning, content, calls, num_reasoning

    def _response(
        self,
        request: ChatForResponses,
        finals: list[RequestOutput],
        request_id: str,
        created: int,
        model: str,
    ) -> ResponseObject:
        final = finals[0]
        c = final.outputs[0]
        reasoning, content, calls, num_reasoning = self._split(final, c, request)
        cut = c.finish_reason == "length"
        item_status = "incomplete" if cut else "completed"
        output: list[dict[str, Any]] = []
        if reasoning is not None:
            output.append(reasoning_item(item_id("rs"), reasoning, item_status))
        if content is not None and (content.strip() or not calls):
            output.append(message_item(item_id("msg"), content, item_status))
        for call in calls:
            output.append(call_item(call.id, call.name, call.arguments, item_status))
        response = self._base(request, request_id, created, model)
        response.output = output
        response.status = "incomplete" if cut else "completed"
        if cut:
            response.incomplete_details = {"reason": "max_output_tokens"}
        response.usage = _usage(final, len(c.token_ids), num_reasoning)
        return response

    async def _stream(
        self,
        request: ChatForResponses,
        streams: list[RequestStream],
        request_id: str,
        created: int,
        model: str,
    ) -> AsyncIterator[str]:
        """OpenAI's Responses stream events: created, in_progress, then each output item
        (added, its deltas, done) as the model writes it, then completed (or incomplete)."""
        events = ResponseEvents()
        response = self._base(request, request_id, created, model)
        yield events.emit("response.created", response=response.model_dump(mode="json"))
        yield events.emit("response.in_progress", response=response.model_dump(mode="json"))
        parser = self.reasoning_parser
        plan = self.tool_plan(request)
        splitter: ReasoningStream | None = None
        tools = ToolCallStream(plan) if plan is not None else None
        text_all = ""
        token_ids: list[int] = []
        final_out: RequestOutput | None = None
        finish_reason: str | None = None
        async for _, out in merge_streams(streams):
            final_out = out
            if (failed := finish_error([out])) is not None:
                response.status = "failed"
                response.error = {"code": failed.err_type, "message": failed.message}
                yield events.emit("response.failed", response=response.model_dump(mode="json"))
                return
            for c in out.outputs:
                text_all += c.text
                token_ids.extend(c.token_ids)
                finish_reason = c.finish_reason or finish_reason
                reasoning, content = None, c.text
                if parser is not None:
                    if splitter is None:
                        splitter = ReasoningStream(parser,
                                                   parser.initial_state(out.prompt_token_ids))
                    reasoning, content = splitter.update(c.text, c.token_ids)
                if reasoning:
                    for e in events.reasoning(reasoning):
                        yield e
                calls: list[dict[str, Any]] = []
                if tools is not None:
                    # A function call's item opens once its name is known; its arguments
                    # stream as the model writes them.
                    content, calls = tools.update(content or "")
                    if c.finish_reason is not None and (rest := tools.finish()) is not None:
                        content = (content or "") + rest
                for e in [*events.answer(content or ""), *events.tool_calls(calls)]:
                    yield e
        cut = finish_reason == "length"
        for e in events.finish("incomplete" if cut else "completed"):
            yield e
        num_reasoning = 0
        if final_out is not None:
            whole = CompletionOutput(index=0, text=text_all, token_ids=token_ids,
                                     finish_reason=finish_reason)
            num_reasoning = self._split(final_out, whole, request)[3]
        response.output = events.output
        response.status = "incomplete" if cut else "completed"
        if cut:
            response.incomplete_details = {"reason": "max_output_tokens"}
        if final_out is not None:
            response.usage = _usage(final_out, len(token_ids), num_reasoning)
        yield events.emit("response.incomplete" if cut else "response.completed",
                          response=response.model_dump(mode="json"))


def _usage(final: RequestOutput, num_output: int, num_reasoning: int) -> ResponseUsage:
    """The usage block of a response."""
    num_input = len(final.prompt_token_ids)
    return ResponseUsage(
        input_tokens=num_input,
        input_tokens_details={"cached_tokens": final.num_cached_tokens},
        output_tokens=num_output,
        output_tokens_details={"reasoning_tokens": num_reasoning},
        total_tokens=num_input + num_output,
    )
