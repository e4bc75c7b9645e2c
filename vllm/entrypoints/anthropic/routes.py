"""The Anthropic routes of the app: POST /v1/messages and /v1/messages/count_tokens, behind
the same request gate as the OpenAI routes (drain and overload 503s, body limits), every
error answered in Anthropic's shape."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response

from vllm.entrypoints.anthropic.errors import anthropic_error, error_response
from vllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from vllm.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from vllm.entrypoints.openai.gate import RequestGate
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


def add_anthropic_routes(
    app: FastAPI,
    engine: AsyncLLM,
    models: OpenAIServingModels,
    gate: RequestGate,
    tool_call_parser: str | None,
    tool_call_strict: str = "off",
) -> None:
    """POST /v1/messages (streaming with stream=true) and /v1/messages/count_tokens, with
    the chat route's tool settings (--tool-call-parser, --tool-call-strict)."""
    messages = AnthropicServingMessages(engine, models, tool_call_parser, tool_call_strict)

    @app.post("/v1/messages")
    async def create_message(raw_request: Request) -> Response:
        """Anthropic's Messages API (streaming with stream=true)."""
        try:
            return anthropic_error(
                await gate.handle(raw_request, MessagesRequest, messages.create_message))
        except Exception as e:
            return _internal_error(e)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(raw_request: Request) -> Response:
        """The token count of a Messages request's prompt."""
        try:
            return anthropic_error(await gate.handle(
                raw_request, CountTokensRequest, messages.count_tokens, generates=False))
        except Exception as e:
            return _internal_error(e)


def _internal_error(e: Exception) -> Response:
    """A logged 500 in Anthropic's shape for anything unexpected."""
    logger.exception("unhandled error")
    return error_response(f"Internal server error: {type(e).__name__}: {e}", 500)
