"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vllm.entrypoints.openai.errors import finish_error
from vllm.entrypoints.openai.logprobs import finite, prompt_logprobs_json, token_logprob
from vllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from vllm.entrypoints.openai.serving_engine import OpenAIServing, usage_info
from vllm.entrypoints.openai.streaming import merge_streams, sse
from vllm.exceptions import InvalidRequestError
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.async_llm import RequestStream


def normalize_prompts(prompt: Any) -> list[str | list[int]]:
    """The list of prompts in a completion request. Raises ValueError if it is empty."""
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise InvalidRequestError("prompt", "must not be empty")
    return prompts


class OpenAIServingCompletion(OpenAIServing):
    """Runs completion requests on the engine; streams them as server-sent events."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        """The HTTP response of one completion request (errors in OpenAI's shape)."""

        def prepare() -> tuple[list[Any], SamplingParams]:
            if request.suffix:
                raise InvalidRequestError("suffix", "is not supported")
            if request.best_of is not None and request.best_of != request.n:
                raise InvalidRequestError("best_of", "only best_of == n is supported")
            prompts = normalize_prompts(request.prompt)
            self.engine.processor.check_num_sequences(len(prompts), request.n)
            return prompts, self.sampling_params(request, request.max_tokens, request.logprobs)

        return await self.serve(request, raw_request, prepare)

    async def _collect(self, streams: list[RequestStream]) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in merge_streams(streams):
            finals[i] = out
        return [f for f in finals if f is not None]

    def _response(
        self,
        request: CompletionRequest,
        finals: list[RequestOutput],
        request_id: str,
        created: int,
        model: str,
    ) -> CompletionResponse:
        choices = []
        num_prompt = num_generated = num_cached = 0
        with_ids = bool(request.return_token_ids)
        for p, final in enumerate(finals):
            num_prompt += len(final.prompt_token_ids)
            num_cached += final.num_cached_tokens
            prompt_text = self._prompt_text(final) if request.echo else ""
            for c in final.outputs:
                num_generated += len(c.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._logprobs(c, request, len(prompt_text))
                    if request.echo:
                        logprobs = self._with_prompt(final, request, logprobs)
                choices.append(
                    CompletionChoice(
                        index=p * request.n + c.index,
                        text=prompt_text + c.text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=(prompt_logprobs_json(final.prompt_logprobs)
                                         if request.prompt_logprobs is not None else None),
                        token_ids=list(c.token_ids) if with_ids else None,
                        prompt_token_ids=list(final.prompt_token_ids) if with_ids else None,
                    )
                )
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=choices,
            usage=usage_info(num_prompt, num_generated, num_cached),
        )

    async def _stream(
        self,
        request: CompletionRequest,
        streams: list[RequestStream],
        request_id: str,
        created: int,
        model: str,
    ) -> AsyncIterator[str]:
        n = request.n
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        continuous = include_usage and bool(request.stream_options.continuous_usage_stats)
        offsets: dict[int, int] = {}
        echoed: set[int] = set()
        with_ids = bool(request.return_token_ids)
        # Choices whose prompt token ids were sent (return_token_ids: in its first chunk).
        ids_sent: set[int] = set()
        prompt_counts: dict[int, int] = {}
        cached_counts: dict[int, int] = {}
        num_generated = 0
        async for p, out in merge_streams(streams):
            if p not in prompt_counts:
                prompt_counts[p] = len(out.prompt_token_ids)
            cached_counts[p] = out.num_cached_tokens
            if (failed := finish_error([out])) is not None:
                yield failed.event()
                return
            choices = []
            for c in out.outputs:
                index = p * n + c.index
                num_generated += len(c.token_ids)
                text = c.text
                first_echo = request.echo and index not in echoed
                if first_echo:
                    echoed.add(index)
                    text = self._prompt_text(out) + text
                    offsets[index] = len(text) - len(c.text)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._logprobs(c, request, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + sum(
                        len(t) for t in logprobs.tokens
                    )
                    if first_echo:  # the echoed prompt's scores come with its text
                        logprobs = self._with_prompt(out, request, logprobs)
                if not text and not c.token_ids and c.finish_reason is None:
                    continue
                choice = CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                if with_ids:
                    choice.token_ids = list(c.token_ids)
                    if index not in ids_sent:
                        ids_sent.add(index)
                        choice.prompt_token_ids = list(out.prompt_token_ids)
                choices.append(choice)
            if not choices:
                continue
            chunk = CompletionStreamResponse(
                id=request_id, created=created, model=model, choices=choices
            )
            if continuous:
                chunk.usage = usage_info(
                    sum(prompt_counts.values()), num_generated, sum(cached_counts.values())
                )
            yield sse(chunk.model_dump_json())
        if include_usage:
            chunk = CompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[],
                usage=usage_info(
                    sum(prompt_counts.values()), num_generated, sum(cached_counts.values())
                ),
            )
            yield sse(chunk.model_dump_json())

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def _with_prompt(
        self, final: RequestOutput, request: CompletionRequest, generated: CompletionLogProbs
    ) -> CompletionLogProbs:
        """`generated` preceded by the echoed prompt's tokens and their scores (the first
        token has none, as nothing predicts it)."""
        k = request.logprobs or 0
        as_ids = request.return_tokens_as_token_ids
        out = CompletionLogProbs()
        offset = 0
        scores = final.prompt_logprobs or [None] * len(final.prompt_token_ids)
        for token_id, entry in zip(final.prompt_token_ids, scores):
            token = self.token_text(token_id, as_ids)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(finite(token_logprob(entry, token_id)))
            top = self.top_logprobs(entry, k)
            out.top_logprobs.append({self.token_text(t, as_ids): lp for t, lp in top})
        out.tokens += generated.tokens
        out.token_logprobs += generated.token_logprobs
        out.top_logprobs += generated.top_logprobs
        out.text_offset += generated.text_offset
        return out

    def _logprobs(
        self, c: CompletionOutput, request: CompletionRequest, start_offset: int
    ) -> CompletionLogProbs:
        k = request.logprobs or 0
        as_ids = request.return_tokens_as_token_ids
        result = CompletionLogProbs()
        offset = start_offset
        for token_id, entry in zip(c.token_ids, c.logprobs or []):
            token = self.token_text(token_id, as_ids)
            result.tokens.append(token)
            result.token_logprobs.append(finite(token_logprob(entry, token_id)))
            result.text_offset.append(offset)
            offset += len(token)
            top = self.top_logprobs(entry, k)
            result.top_logprobs.append({self.token_text(t, as_ids): lp for t, lp in top})
        return result
