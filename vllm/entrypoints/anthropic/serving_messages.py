"""POST /v1/messages and /v1/messages/count_tokens, served by the chat path.

`AnthropicServingMessages` is the chat handler with Anthropic's answer: the request is
translated into a chat request (translate.py) and run by the chat path's own `serve` (chat
template, sampling parameters, tool plan and its constraint, reasoning split, admission);
only the finished reply is written differently, as content blocks (thinking, text,
tool_use) with a stop reason, or as Anthropic's stream events (streaming.py). Errors leave
here in OpenAI's shape with Anthropic's field names; the routes convert their shape
(errors.anthropic_error)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vllm.entrypoints.anthropic.errors import error_event
from vllm.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    Usage,
)
from vllm.entrypoints.anthropic.streaming import MessageEvents, anthropic_events
from vllm.entrypoints.anthropic.translate import (
    ChatForMessages,
    anthropic_param,
    stop_reason,
    to_chat_request,
    tool_input,
    tool_use_id,
)
from vllm.entrypoints.openai.errors import error_response, exception_error, finish_error
from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_engine import json_response
from vllm.entrypoints.openai.serving_tokenization import TOKENIZE_CHARS_PER_TOKEN
from vllm.entrypoints.openai.streaming import merge_streams
from vllm.entrypoints.openai.tools import ToolCall, ToolCallStream, parse_reply
from vllm.exceptions import InvalidRequestError
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, OutputKind, RequestOutput
from vllm.reasoning import ReasoningStream
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.async_llm import RequestStream


def _renamed(e: InvalidRequestError,
             chat_request: ChatForMessages | None = None) -> InvalidRequestError:
    """The same error naming the Anthropic field instead of the chat field (a content part
    by the block it came from in `chat_request`)."""
    places = chat_request._places if chat_request is not None else None
    return type(e)(anthropic_param(e.param, places), e.message)


def content_blocks(reasoning: str | None, text: str | None,
                   calls: list[ToolCall]) -> list[dict[str, Any]]:
    """The content of a finished reply: its thinking, its text (only when it holds more
    than whitespace; trailing whitespace left out when tool calls follow), its tool calls."""
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = text or ""
    if calls:
        text = text.rstrip()
    if text.strip():
        blocks.append({"type": "text", "text": text})
    for call in calls:
        blocks.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
                       "input": tool_input(call.arguments)})
    return blocks


class AnthropicServingMessages(OpenAIServingChat):
    """Runs Messages requests through the chat path and answers with Anthropic messages."""

    id_prefix = "msg"

    async def create_message(self, request: MessagesRequest, raw_request: Request) -> Response:
        """The HTTP response of one Messages request (a message, or its stream of events);
        an error answer names the Anthropic field at fault."""
        try:
            chat_request = to_chat_request(request)
        except InvalidRequestError as e:
            return exception_error(e).response()

        def prepare() -> tuple[list[Any], SamplingParams]:
            try:
                return self.prepare_chat(chat_request)
            except InvalidRequestError as e:
                raise _renamed(e, chat_request) from None

        return await self.serve(chat_request, raw_request, prepare)

    async def count_tokens(self, request: CountTokensRequest, raw_request: Request) -> Response:
        """`{"input_tokens": N}`: the tokens of the prompt the request renders to, an
        image's placeholder tokens included (what /tokenize gives for the same chat
        messages); 404 for an unknown model, 400 naming the field for input that cannot be
        rendered or is too long to tokenize."""
        if self.models.resolve(request.model) is None:
            return error_response(f"The model `{request.model}` does not exist.", 404,
                                  param="model")
        limit = self.max_model_len * TOKENIZE_CHARS_PER_TOKEN

        def run() -> int:
            chat_request = to_chat_request(request)
            try:
                text, chat = self.render_prompt(chat_request)
                if len(text) > limit:
                    raise InvalidRequestError(
                        "messages", f"the rendered conversation is {len(text)} characters; "
                        f"at most {limit} ({TOKENIZE_CHARS_PER_TOKEN} per token of "
                        f"max_model_len {self.max_model_len})")
                tokens = self.tokenizer.encode(text, add_special_tokens=False)
                if chat.images:
                    # Each image counts its placeholder tokens, as the engine will see them.
                    tokens, _ = self.engine.processor.process_images(chat.prompt(text), tokens)
            except InvalidRequestError as e:
                raise _renamed(e, chat_request) from None
            return len(tokens)

        try:
            # Rendering and encoding are linear in the input: off the event loop.
            count = await asyncio.to_thread(run)
        except ValueError as e:
            return exception_error(e).response()
        return json_response(CountTokensResponse(input_tokens=count))

    async def add_requests(
        self,
        request_id: str,
        prompts: list[Any],
        params: SamplingParams,
        kind: OutputKind,
        lora_request: LoRARequest | None = None,
        **options: Any,
    ) -> list[RequestStream]:
        """The chat path's admission (`options`, such as the priority, passed on as
        given), with a rejected field (a tool's constraint, the token budget) named as the
        Anthropic request spells it."""
        try:
            return await super().add_requests(request_id, prompts, params, kind, lora_request,
                                              **options)
        except InvalidRequestError as e:
            raise _renamed(e) from None

    def event_stream(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """Anthropic's framing: no `[DONE]`, a failure as a final `error` event."""
        return anthropic_events(chunks)

    # ------------------------------------------------------------------ the answer

    def _split(self, final: RequestOutput, c: CompletionOutput,
               request: ChatCompletionRequest) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, answer text, tool calls) of a finished reply."""
        parser = self.reasoning_parser
        reasoning, content = None, c.text
        if parser is not None:
            state = parser.resolve(parser.initial_state(final.prompt_token_ids), c.token_ids)
            reasoning, content = parser.split(state, c.text)
        calls: list[ToolCall] = []
        plan = self.tool_plan(request)
        if plan is not None:
            content, calls = parse_reply(plan, content)
        return reasoning, content, calls

    def _response(
        self,
        request: ChatCompletionRequest,
        finals: list[RequestOutput],
        request_id: str,
        created: int,
        model: str,
    ) -> MessageResponse:
        final = finals[0]
        c = final.outputs[0]
        reasoning, content, calls = self._split(final, c, request)
        reason, sequence = stop_reason(c.finish_reason, c.stop_reason, bool(calls))
        return MessageResponse(
            id=request_id, model=model, content=content_blocks(reasoning, content, calls),
            stop_reason=reason, stop_sequence=sequence,
            usage=Usage(input_tokens=len(final.prompt_token_ids),
                        output_tokens=len(c.token_ids)),
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        streams: list[RequestStream],
        request_id: str,
        created: int,
        model: str,
    ) -> AsyncIterator[str]:
        """Anthropic's stream events (streaming.MessageEvents) as the reply is written."""
        events = MessageEvents(request_id, model)
        parser = self.reasoning_parser
        plan = self.tool_plan(request)
        splitter: ReasoningStream | None = None
        tools = ToolCallStream(plan) if plan is not None else None
        started = False
        num_generated = 0
        finish: str | None = None
        matched: int | str | None = None
        async for _, out in merge_streams(streams):
            if not started:
                # The prompt's token count is known from the first output on.
                started = True
                yield events.start(len(out.prompt_token_ids))
            if (failed := finish_error([out])) is not None:
                yield error_event(failed.message, failed.status)
                return
            for c in out.outputs:
                num_generated += len(c.token_ids)
                reasoning, content = None, c.text
                if parser is not None:
                    if splitter is None:
                        splitter = ReasoningStream(parser,
                                                   parser.initial_state(out.prompt_token_ids))
                    reasoning, content = splitter.update(c.text, c.token_ids)
                calls: list[dict[str, Any]] = []
                if tools is not None:
                    content, calls = tools.update(content or "")
                    if c.finish_reason is not None and (rest := tools.finish()) is not None:
                        content = (content or "") + rest
                pieces = events.thinking(reasoning) if reasoning else []
                if content:
                    pieces += events.text(content)
                for delta in calls:
                    pieces += events.tool_call(delta)
                for piece in pieces:
                    yield piece
                if c.finish_reason is not None:
                    finish, matched = c.finish_reason, c.stop_reason
        if not started:
            yield events.start(0)
        has_calls = tools is not None and tools.num_calls > 0
        reason, sequence = stop_reason(finish, matched, has_calls)
        for piece in events.finish(reason, sequence, num_generated):
            yield piece
