"""Pydantic models of OpenAI's Responses API (POST /v1/responses): the request, the
response object and its output items."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm.entrypoints.openai.protocol import OpenAIBaseModel, ResponseModel


class ResponsesTextFormat(OpenAIBaseModel):
    """`text.format`: free text, a named JSON schema, or any JSON object."""

    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    # `schema` would shadow a BaseModel attribute.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesTextConfig(OpenAIBaseModel):
    """`text`: the output's format (and OpenAI's verbosity hint, accepted and ignored)."""

    format: ResponsesTextFormat | None = None
    verbosity: str | None = None


class ResponsesReasoningConfig(OpenAIBaseModel):
    """`reasoning`: the effort is passed to the chat template; summaries are not written."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesTool(BaseModel):
    """One entry of `tools`: only `type: "function"` is served (others are a 400 naming
    `tools[i].type`), so the fields of other tool types pass validation to be named there."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses: OpenAI's fields, and a few of upstream vLLM's sampling extras."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: ResponsesTextConfig | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ResponsesReasoningConfig | None = None
    stream: bool = False
    # Accepted and ignored: nothing is stored here, so responses are never retrievable.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    # Fields that would change the reply and that this engine does not implement: a 400
    # naming them when set.
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    # Upstream vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    thinking_token_budget: int | None = None
    request_id: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class ResponseUsage(ResponseModel):
    """Token counts of a response."""

    input_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(
        default_factory=lambda: {"reasoning_tokens": 0}
    )
    total_tokens: int


class ResponseObject(ResponseModel):
    """The response object (the body of a non-streaming answer, and of stream events)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"] = "completed"
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    model: str
    # message, reasoning and function_call items, in the order the model wrote them.
    output: list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool = False
    background: bool = False
    truncation: str = "disabled"
    previous_response_id: str | None = None
    service_tier: str = "auto"
    user: str | None = None
    usage: ResponseUsage | None = None
