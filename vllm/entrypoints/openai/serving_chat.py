"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vllm.entrypoints.openai.errors import finish_error
from vllm.entrypoints.openai.logprobs import finite, prompt_logprobs_json, token_logprob
from vllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogProbs,
    ChatStreamChoice,
    DeltaMessage,
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
)
from vllm.entrypoints.openai.sampling import structured_outputs_params
from vllm.entrypoints.openai.serving_engine import OpenAIServing, usage_info
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.entrypoints.openai.streaming import merge_streams, sse
from vllm.entrypoints.openai.tools import (
    ToolCall,
    ToolCallStream,
    ToolPlan,
    parse_reply,
    plan_tools,
)
from vllm.exceptions import InvalidRequestError
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.reasoning import ReasoningParser, ReasoningStream
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.multimodal.chat import ChatImages
from vllm.v1.engine.async_llm import AsyncLLM, RequestStream


class OpenAIServingChat(OpenAIServing):
    """Renders the chat template, runs the request, and answers in the chat format."""

    id_prefix = "chatcmpl"

    def __init__(
        self, engine: AsyncLLM, models: OpenAIServingModels, tool_call_parser: str | None = None,
        tool_call_strict: str = "off",
    ) -> None:
        super().__init__(engine, models)
        # The --tool-call-parser of a server with --enable-auto-tool-choice, else None.
        self.tool_call_parser = tool_call_parser
        # --tool-call-strict: off, function or parameter (see tools.py).
        self.tool_call_strict = tool_call_strict

    @property
    def reasoning_parser(self) -> ReasoningParser | None:
        """The server's --reasoning-parser (None without one)."""
        return self.engine.constraint_checker.reasoning_parser

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        """The HTTP response of one chat request (errors in OpenAI's shape)."""
        return await self.serve(request, raw_request, lambda: self.prepare_chat(request))

    def prepare_chat(self, request: ChatCompletionRequest) -> tuple[list[Any], SamplingParams]:
        """The prompt (the rendered conversation) and sampling parameters of a chat request,
        its tool plan's constraint included. Raises InvalidRequestError naming the field."""
        if request.top_logprobs is not None and not request.logprobs:
            raise InvalidRequestError("top_logprobs", "requires logprobs to be true")
        refuse_unimplemented(request)
        plan = self.tool_plan(request)
        constraint = None
        if plan is not None and (given := plan.constraint()) is not None:
            if structured_outputs_params(request) is not None:
                raise InvalidRequestError(
                    "tool_choice",
                    f"{request.tool_choice or 'auto'!r} with strict or forced tools "
                    "cannot be combined with response_format or structured_outputs",
                )
            constraint = StructuredOutputsParams(**{given[0]: given[1]},
                                                 disable_additional_properties=plan.closed)
        text, chat = self.render_prompt(request)
        prompt = chat.prompt(text, request.mm_processor_kwargs)
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        return [prompt], self.sampling_params(request, max_tokens, logprobs, constraint)

    def tool_plan(self, request: ChatCompletionRequest) -> ToolPlan | None:
        """What the request does with its tools (None without tools), made on the first call
        and kept on the request. Raises InvalidRequestError naming the bad field."""
        if not request._tool_plan_made:
            request._tool_plan = plan_tools(request.tools, request.tool_choice,
                                            request.parallel_tool_calls, self.tool_call_parser,
                                            self.tool_call_strict)
            request._tool_plan_made = True
        return request._tool_plan

    def render(self, request: ChatCompletionRequest) -> str:
        """The prompt text of the conversation (an image as the model's placeholder).
        Raises ValueError for unusable messages."""
        return self.render_prompt(request)[0]

    def message_names(self, request: ChatCompletionRequest) -> list[str] | None:
        """How the client named each message in errors; None: messages[i]."""
        return None

    def render_prompt(self, request: ChatCompletionRequest) -> tuple[str, ChatImages]:
        """The prompt text of the conversation and the images its parts carry (loaded and
        checked; vllm/multimodal/chat.py). Raises ValueError for unusable messages or
        images, naming the part."""
        chat = self.engine.processor.chat_images(
            [m.model_dump(exclude_none=True) for m in request.messages],
            self.message_names(request))
        messages = chat.messages
        kwargs = dict(request.chat_template_kwargs or {})
        if request.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", request.reasoning_effort)
        if request.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in request.tools]
        if request.continue_final_message:
            kwargs["continue_final_message"] = True
            kwargs["add_generation_prompt"] = False
        else:
            kwargs["add_generation_prompt"] = request.add_generation_prompt
        try:
            return self.engine.processor.apply_chat_template(messages, **kwargs), chat
        except ValueError:
            raise
        except Exception as e:  # template errors (jinja) are the request's fault
            raise InvalidRequestError("messages", f"cannot apply the chat template: {e}") from e

    async def _collect(self, streams: list[RequestStream]) -> list[RequestOutput]:
        final = None
        async for _, out in merge_streams(streams):
            final = out
        assert final is not None
        return [final]

    def _response(
        self,
        request: ChatCompletionRequest,
        finals: list[RequestOutput],
        request_id: str,
        created: int,
        model: str,
    ) -> ChatCompletionResponse:
        final = finals[0]
        choices = []
        num_generated = 0
        parser = self.reasoning_parser
        plan = self.tool_plan(request)
        for c in final.outputs:
            num_generated += len(c.token_ids)
            reasoning, content = None, c.text
            if parser is not None:
                state = parser.resolve(parser.initial_state(final.prompt_token_ids), c.token_ids)
                reasoning, content = parser.split(state, c.text)
            calls: list[ToolCall] = []
            if plan is not None:
                content, calls = parse_reply(plan, content)
                if content is None and plan.mode in ("required", "named"):
                    content = ""  # what upstream answers beside a forced call
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ResponseMessage(
                        role="assistant", content=content, reasoning=reasoning,
                        reasoning_content=reasoning,
                        tool_calls=[call.as_dict() for call in calls] or None,
                    ),
                    logprobs=self._logprobs(c, request) if request.logprobs else None,
                    finish_reason=_finish_reason(c.finish_reason, bool(calls)),
                    stop_reason=c.stop_reason,
                    token_ids=list(c.token_ids) if request.return_token_ids else None,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=choices,
            usage=usage_info(len(final.prompt_token_ids), num_generated, final.num_cached_tokens),
            prompt_logprobs=(prompt_logprobs_json(final.prompt_logprobs)
                             if request.prompt_logprobs is not None else None),
            prompt_token_ids=(list(final.prompt_token_ids) if request.return_token_ids
                              else None),
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        streams: list[RequestStream],
        request_id: str,
        created: int,
        model: str,
    ) -> AsyncIterator[str]:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        continuous = include_usage and bool(request.stream_options.continuous_usage_stats)
        num_prompt = num_generated = num_cached = 0

        def chunk(choices: list[ChatStreamChoice],
                  prompt_token_ids: list[int] | None = None) -> str:
            body = ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=choices,
                prompt_token_ids=prompt_token_ids,
            )
            if continuous:
                body.usage = usage_info(num_prompt, num_generated, num_cached)
            return sse(body.model_dump_json())

        # The role comes first, before the first token, as OpenAI sends it (with
        # return_token_ids, the prompt's ids come with it, as upstream sends them).
        yield chunk(
            [ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
             for i in range(request.n)],
            list(streams[0].prompt_token_ids) if request.return_token_ids else None,
        )
        parser = self.reasoning_parser
        plan = self.tool_plan(request)
        splitters: dict[int, ReasoningStream] = {}
        tool_streams: dict[int, ToolCallStream] = {}
        async for _, out in merge_streams(streams):
            num_prompt = len(out.prompt_token_ids)
            num_cached = out.num_cached_tokens
            if (failed := finish_error([out])) is not None:
                yield failed.event()
                return
            choices = []
            for c in out.outputs:
                num_generated += len(c.token_ids)
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                reasoning, content = None, c.text
                if parser is not None:
                    if c.index not in splitters:
                        state = parser.initial_state(out.prompt_token_ids)
                        splitters[c.index] = ReasoningStream(parser, state)
                    reasoning, content = splitters[c.index].update(c.text, c.token_ids)
                calls: list[dict[str, Any]] = []
                has_calls = False
                if plan is not None:
                    tools = tool_streams.setdefault(c.index, ToolCallStream(plan))
                    content, calls = tools.update(content or "")
                    if c.finish_reason is not None and (rest := tools.finish()) is not None:
                        content = (content or "") + rest
                    has_calls = tools.num_calls > 0
                choices.append(
                    ChatStreamChoice(
                        index=c.index,
                        delta=DeltaMessage(content=content, reasoning=reasoning,
                                           reasoning_content=reasoning,
                                           tool_calls=calls or None),
                        logprobs=self._logprobs(c, request) if request.logprobs else None,
                        finish_reason=_finish_reason(c.finish_reason, has_calls),
                        stop_reason=c.stop_reason,
                        token_ids=list(c.token_ids) if request.return_token_ids else None,
                    )
                )
            if choices:
                yield chunk(choices)
        if include_usage:
            body = ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[],
                usage=usage_info(num_prompt, num_generated, num_cached),
            )
            yield sse(body.model_dump_json())

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
                    logprob=finite(_or_masked(token_logprob(entry, token_id))),
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=top,
                )
            )
        return ChatLogProbs(content=content)


def _or_masked(logprob: float | None) -> float:
    """A sampled token missing from its position's logprobs can only have been masked."""
    return float("-inf") if logprob is None else logprob


def refuse_unimplemented(request: ChatCompletionRequest) -> None:
    """Raises InvalidRequestError naming an OpenAI field that would change the reply and that
    this engine does not implement."""
    if request.modalities is not None and set(request.modalities) - {"text"}:
        raise InvalidRequestError("modalities", "only [\"text\"] is supported")
    for name, why in (
        ("audio", "audio output is not supported"),
        ("prediction", "predicted outputs are not supported"),
        ("web_search_options", "web search is not supported"),
        ("functions", "is deprecated by OpenAI and not supported: use tools"),
        ("function_call", "is deprecated by OpenAI and not supported: use tool_choice"),
    ):
        if getattr(request, name) is not None:
            raise InvalidRequestError(name, why)


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that stopped after calling tools."""
    return "tool_calls" if reason == "stop" and has_calls else reason
