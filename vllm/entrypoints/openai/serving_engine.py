"""The base of the completion, chat and responses handlers (`OpenAIServing`): checks, sampling
parameters, running a request and its streams. Errors, body reading, sampling parameters,
streaming and logprob formatting each have a module of their own in this package."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm.entrypoints.openai.errors import (
    ClientDisconnected,
    error_response,
    exception_error,
    finish_error,
)
from vllm.entrypoints.openai.logprobs import finite
from vllm.entrypoints.openai.protocol import (
    OpenAIBaseModel,
    PromptTokensDetails,
    SamplingRequestFields,
    UsageInfo,
    random_id,
)
from vllm.entrypoints.openai.sampling import sampling_params
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.entrypoints.openai.streaming import cancel_on_disconnect, sse_events
from vllm.exceptions import EngineDeadError
from vllm.logprobs import Logprob
from vllm.lora.request import LoRARequest
from vllm.outputs import OutputKind, RequestOutput
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM, RequestStream

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=OpenAIBaseModel)


class OpenAIServing:
    """Base of the completion and chat handlers.

    A subclass sets `id_prefix` and provides `_collect` (the final outputs of its streams),
    `_response` (the full JSON response) and `_stream` (the server-sent event chunks); `serve`
    runs one request through them.
    """

    id_prefix = "cmpl"

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.model_config.max_model_len
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------ checks

    def check_model(self, request: SamplingRequestFields) -> str | JSONResponse:
        """The served name to report, or a 404 error for an unknown model."""
        name = self.models.resolve(request.model)
        if name is None:
            return error_response(
                f"The model `{request.model}` does not exist.", 404, param="model"
            )
        return name

    def engine_dead_response(self) -> JSONResponse | None:
        """503 when the engine process is gone, else None."""
        if self.engine.errored:
            return error_response(
                f"The engine is not available: {self.engine.dead_reason}", 503
            )
        return None

    # ------------------------------------------------------------------ parameters

    def sampling_params(
        self,
        request: SamplingRequestFields,
        max_tokens: int | None,
        logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """SamplingParams of a request, with the model's generation-config defaults for what
        it leaves unset (see `sampling.sampling_params`)."""
        return sampling_params(request, max_tokens, logprobs,
                               self.engine.model_config.sampling_defaults, structured_outputs)

    # ------------------------------------------------------------------ running

    async def serve(
        self,
        request: SamplingRequestFields,
        raw_request: Request,
        prepare: Callable[[], tuple[list[Any], SamplingParams]],
    ) -> Response:
        """The HTTP response of one request (errors in OpenAI's shape).

        `prepare` gives the prompts and sampling parameters, raising ValueError (a 400) for bad
        input. A disconnecting client gets 499 and its engine requests are aborted.
        """
        model = self.check_model(request)
        if isinstance(model, JSONResponse):
            return model
        if (dead := self.engine_dead_response()) is not None:
            return dead
        try:
            # Rendering a chat template and building parameters is Python work proportional
            # to the request: off the event loop, so /health and other requests stay live.
            prompts, params = await asyncio.to_thread(prepare)
            request_id = request.request_id or random_id(self.id_prefix)
            # A non-streaming request reads only its final output: none is built before.
            kind = OutputKind.DELTA if request.stream else OutputKind.FINAL_ONLY
            lora = self.models.lora_request(model)
            streams = await self.add_requests(
                request_id, with_cache_salt(prompts, request.cache_salt), params, kind, lora,
                priority=request.priority,
            )
        except (ValueError, EngineDeadError) as e:
            return exception_error(e).response()
        created = int(time.time())
        if request.stream:
            return StreamingResponse(
                self.event_stream(self._stream(request, streams, request_id, created, model)),
                media_type="text/event-stream",
            )
        try:
            finals = await cancel_on_disconnect(self._collect(streams), raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        except EngineDeadError as e:
            return exception_error(e).response()
        if (failed := finish_error(finals)) is not None:
            return failed.response()
        return json_response(self._response(request, finals, request_id, created, model))

    def event_stream(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """The body of a streaming answer: `chunks` framed as this API frames a stream
        (OpenAI's: then `[DONE]`, a failure as a final error event; see `sse_events`)."""
        return sse_events(chunks)

    async def _collect(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """The final output of each stream, in stream order."""
        raise NotImplementedError

    def _response(
        self,
        request: Any,
        finals: list[RequestOutput],
        request_id: str,
        created: int,
        model: str,
    ) -> OpenAIBaseModel:
        """The full (non-streaming) response model of a finished request."""
        raise NotImplementedError

    def _stream(
        self,
        request: Any,
        streams: list[RequestStream],
        request_id: str,
        created: int,
        model: str,
    ) -> AsyncIterator[str]:
        """The server-sent event chunks of a streaming request, without the closing
        `[DONE]`; raises EngineDeadError if the engine dies."""
        raise NotImplementedError

    async def add_requests(
        self,
        request_id: str,
        prompts: list[Any],
        params: SamplingParams,
        kind: OutputKind,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> list[RequestStream]:
        """Admits one engine request per prompt (with the adapter of `lora_request`, if
        any, at `priority`). On any error, aborts the ones admitted and re-raises
        (ValueError: bad input; EngineDeadError: no engine)."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(
                    await self.engine.add_request(rid, prompt, params, kind, lora_request,
                                                  priority)
                )
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    # ------------------------------------------------------------------ logprobs

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        """The text of one token as logprobs show it (special tokens included), or
        `token_id:<id>` with `as_id`."""
        if as_id:
            return f"token_id:{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 1_000_000:
                self._token_text[token_id] = text
        return text

    def top_logprobs(self, entry: dict[int, Logprob], k: int) -> list[tuple[int, float]]:
        """The k most likely tokens of one position, most likely first (logprobs finite)."""
        if k <= 0:
            return []
        ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
        return [(t, finite(lp.logprob)) for t, lp in ranked]


def with_cache_salt(prompts: list[Any], cache_salt: str | None) -> list[Any]:
    """The prompts as the engine takes them with a request's `cache_salt`: each a dict
    prompt carrying the salt (upstream's prompt field); unchanged without a salt."""
    if cache_salt is None:
        return prompts
    out: list[Any] = []
    for prompt in prompts:
        if isinstance(prompt, dict):
            out.append({**prompt, "cache_salt": cache_salt})
        elif isinstance(prompt, str):
            out.append({"prompt": prompt, "cache_salt": cache_salt})
        else:
            out.append({"prompt_token_ids": prompt, "cache_salt": cache_salt})
    return out


def usage_info(num_prompt: int, num_generated: int, num_cached: int) -> UsageInfo:
    """The usage block of a response (cached prompt tokens only when there are some)."""
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_generated,
        total_tokens=num_prompt + num_generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached) if num_cached else None,
    )


def json_response(model: Any, status: int = 200) -> Response:
    """A pydantic response model as a JSON response."""
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")
