"""Pydantic models of Anthropic's Messages API: the request bodies of /v1/messages and
/v1/messages/count_tokens and the message a non-streaming request answers with.

Content blocks stay plain dicts here: `translate.py` checks each one, so that an unsupported
block (a document, a search result) is refused with a message naming it and saying why, rather than
with a union's validation error."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm.entrypoints.openai.protocol import OpenAIBaseModel, ResponseModel


class SystemTextBlock(OpenAIBaseModel):
    """One text block of `system`."""

    type: Literal["text"]
    text: str
    # Prompt caching is automatic here (prefix caching), so a cache breakpoint changes
    # nothing: accepted and not needed.
    cache_control: dict[str, Any] | None = None


class InputMessage(OpenAIBaseModel):
    """One turn of `messages`: a string or a list of content blocks."""

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Tool(BaseModel):
    """One entry of `tools`. Only client tools (no `type`, or `custom`) are served; another
    `type` (Anthropic's server tools) is a 400 naming `tools[i].type`, so their fields pass
    validation to be named there."""

    model_config = ConfigDict(extra="allow")

    type: str | None = None
    name: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    # Constrains every call of this tool to `input_schema` (as the chat API's strict).
    strict: bool | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(OpenAIBaseModel):
    """`tool_choice`: auto (the model decides), any (some tool), tool (the one named) or
    none (no tool)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(OpenAIBaseModel):
    """`thinking`: extended thinking on (with a token budget) or off."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class CountTokensRequest(OpenAIBaseModel):
    """POST /v1/messages/count_tokens: what the prompt is made of."""

    model: str
    messages: list[InputMessage]
    system: str | list[SystemTextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    # {"user_id": ...}: Anthropic's abuse tracking, which has no counterpart here.
    metadata: dict[str, Any] | None = None


class Usage(ResponseModel):
    """Token counts: the rendered prompt's and the reply's."""

    input_tokens: int
    output_tokens: int


class MessageResponse(ResponseModel):
    """The body of a non-streaming /v1/messages answer."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[dict[str, Any]]
    model: str
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(ResponseModel):
    """The body of a /v1/messages/count_tokens answer."""

    input_tokens: int
