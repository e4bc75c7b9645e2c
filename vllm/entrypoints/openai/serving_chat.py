"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogProbs,
    ChatStreamChoice,
    DeltaMessage,
    PromptTokensDetails,
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from vllm.entrypoints.openai.serving_engine import (
    ClientDisconnected,
    OpenAIServing,
    cancel_on_disconnect,
    error_body,
    error_response,
    error_status,
    finish_error,
    finite,
    json_response,
    merge_streams,
    value_error_response,
)
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.engine.async_llm import EngineDeadError


class OpenAIServingChat(OpenAIServing):
    """Renders the chat template, runs the request, and answers in the chat format."""

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        """The HTTP response of one chat request (errors in OpenAI's shape)."""
        model = self.check_model(request)
        if isinstance(model, JSONResponse):
            return model
        if (dead := self.engine_dead_response()) is not None:
            return dead
        try:
            if request.tools:
                raise ValueError("tools: tool calling is not supported by this server")
            if request.top_logprobs is not None and not request.logprobs:
                raise ValueError("top_logprobs: requires logprobs to be true")
            prompt = self.render(request)
            max_tokens = request.max_completion_tokens
            if max_tokens is None:
                max_tokens = request.max_tokens
            logprobs = (request.top_logprobs or 0) if request.logprobs else None
            params = self.sampling_params(request, max_tokens, logprobs)
            request_id = request.request_id or random_id("chatcmpl")
            streams = await self.add_requests(request_id, [prompt], params, delta=request.stream)
        except ValueError as e:
            return value_error_response(e)
        except EngineDeadError as e:
            return error_response(f"The engine is not available: {e}", 503)
        created = int(time.time())
        if request.stream:
            return StreamingResponse(
                self._stream(request, streams, request_id, created, model),
                media_type="text/event-stream",
            )
        try:
            final = await cancel_on_disconnect(self._collect(streams), raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        except EngineDeadError as e:
            return error_response(f"The engine is not available: {e}", 503)
        if (message := finish_error([final])) is not None:
            return error_response(message, error_status(message))
        return json_response(self._response(request, final, request_id, created, model))

    def render(self, request: ChatCompletionRequest) -> str:
        """The prompt text of the conversation. Raises ValueError for unusable messages."""
        messages: list[dict[str, Any]] = []
        for i, m in enumerate(request.messages):
            msg = m.model_dump(exclude_none=True)
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise ValueError(
                            f"messages[{i}].content: only text parts are supported"
                        )
                    texts.append(part["text"])
                msg["content"] = "".join(texts)
            elif content is None:
                msg["content"] = ""
            messages.append(msg)
        kwargs = dict(request.chat_template_kwargs or {})
        if request.continue_final_message:
            kwargs["continue_final_message"] = True
            kwargs["add_generation_prompt"] = False
        else:
            kwargs["add_generation_prompt"] = request.add_generation_prompt
        try:
            return self.engine.processor.apply_chat_template(messages, **kwargs)
        except ValueError:
            raise
        except Exception as e:  # template errors (jinja) are the request's fault
            raise ValueError(f"messages: cannot apply the chat template: {e}") from e

    async def _collect(self, streams) -> RequestOutput:
        final = None
        async for _, out in merge_streams(streams):
            final = out
        assert final is not None
        return final

    def _response(
        self,
        request: ChatCompletionRequest,
        final: RequestOutput,
        request_id: str,
        created: int,
        model: str,
    ) -> ChatCompletionResponse:
        choices = []
        num_generated = 0
        for c in final.outputs:
            num_generated += len(c.token_ids)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ResponseMessage(role="assistant", content=c.text),
                    logprobs=self._logprobs(c, request) if request.logprobs else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=choices,
            usage=_usage(len(final.prompt_token_ids), num_generated, final.num_cached_tokens),
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        streams,
        request_id: str,
        created: int,
        model: str,
    ) -> AsyncIterator[str]:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        continuous = include_usage and bool(request.stream_options.continuous_usage_stats)
        num_prompt = num_generated = num_cached = 0

        def chunk(choices: list[ChatStreamChoice]) -> str:
            body = ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=choices
            )
            if continuous:
                body.usage = _usage(num_prompt, num_generated, num_cached)
            return f"data: {body.model_dump_json()}\n\n"

        try:
            # The role comes first, before the first token, as OpenAI sends it.
            yield chunk([
                ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                for i in range(request.n)
            ])
            async for _, out in merge_streams(streams):
                num_prompt = len(out.prompt_token_ids)
                num_cached = out.num_cached_tokens
                if (message := finish_error([out])) is not None:
                    body = error_body(message, error_status(message))
                    yield f"data: {body.model_dump_json()}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                choices = []
                for c in out.outputs:
                    num_generated += len(c.token_ids)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    choices.append(
                        ChatStreamChoice(
                            index=c.index,
                            delta=DeltaMessage(content=c.text),
                            logprobs=self._logprobs(c, request) if request.logprobs else None,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                    )
                if choices:
                    yield chunk(choices)
            if include_usage:
                body = ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[],
                    usage=_usage(num_prompt, num_generated, num_cached),
                )
                yield f"data: {body.model_dump_json()}\n\n"
        except EngineDeadError as e:
            body = error_body(f"The engine is not available: {e}", 503)
            yield f"data: {body.model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"

    def _logprobs(self, c: CompletionOutput, request: ChatCompletionRequest) -> ChatLogProbs:
        k = request.top_logprobs or 0
        as_ids = request.return_tokens_as_token_ids
        content = []
        for token_id, entry in zip(c.token_ids, c.logprobs or []):
            token = self.token_text(token_id, as_ids)
            top = [
                TopLogprob(token=(t := self.token_text(tid, as_ids)), logprob=lp,
                           bytes=list(t.encode("utf-8")))
                for tid, lp in self.top_logprobs(entry, k)
            ]
            content.append(
                TokenLogprob(
                    token=token,
                    logprob=finite(entry.get(token_id, float("-inf"))),
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=top,
                )
            )
        return ChatLogProbs(content=content)


def _usage(num_prompt: int, num_generated: int, num_cached: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_generated,
        total_tokens=num_prompt + num_generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached) if num_cached else None,
    )
