"""Pydantic models of the OpenAI-compatible API: requests, responses, stream chunks, errors."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_serializer


# The default --max-request-body-bytes. Parsing and validating a body holds the GIL (and so
# the event loop) for time linear in its size: 16 MiB is a few hundred milliseconds at worst and
# far above any text prompt that fits a context window.
DEFAULT_MAX_BODY_BYTES = 16 << 20


def random_id(prefix: str) -> str:
    """A fresh response id such as `cmpl-3f2a...`."""
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    """Request models reject unknown fields, so a typo is a 400 instead of being ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


class ResponseModel(BaseModel):
    """Response models (lenient)."""

    model_config = ConfigDict(populate_by_name=True)


# ---------------------------------------------------------------------------- errors


class ErrorInfo(ResponseModel):
    """The error object: what went wrong, its type, the offending field, the HTTP status."""

    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(ResponseModel):
    """`{"error": {"message", "type", "param", "code"}}`, as OpenAI returns errors."""

    error: ErrorInfo


# ---------------------------------------------------------------------------- models


class ModelCard(ResponseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    # The base model of a LoRA adapter (None for a base model).
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    """The body of GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------------- shared request parts


class StreamOptions(OpenAIBaseModel):
    """Streaming options: include_usage adds a final chunk with token counts."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(OpenAIBaseModel):
    """response_format.json_schema: a named JSON schema."""

    name: str | None = None
    description: str | None = None
    # `schema` would shadow a BaseModel attribute.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format; structural-tag fields pass through as extras."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """The extra-body `structured_outputs` object (one constraint)."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    max_whitespace: int | None = None
    backend: str | None = None
    # Grammar fast-forward for this request: off, exact or canonical (None: the server's).
    # Checked by StructuredOutputsParams, whose message names the field.
    fast_forward: Any = None


class RepetitionDetectionRequest(OpenAIBaseModel):
    """The extra-body `repetition_detection` object: stop once the output ends in a pattern of
    min_pattern_size (0: 1) to max_pattern_size tokens repeated min_count times (ranges are
    checked by RepetitionDetectionParams, whose messages name the field)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


class SamplingRequestFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # Upstream's per-request backend for the guided_* fields (and any other constraint).
    guided_decoding_backend: str | None = None
    # Logprob tokens as "token_id:<id>" instead of their text (exact, for checking).
    return_tokens_as_token_ids: bool = False
    # Scores of the prompt's tokens: each one's logprob (and the top-k) under those before it.
    prompt_logprobs: int | None = None
    # Most tokens the reply may think before the engine ends its thinking block (needs
    # --reasoning-parser).
    thinking_token_budget: int | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words that must never appear in the output.
    bad_words: list[str] | None = None
    # Its place under --scheduling-policy priority (lower first); nonzero under fcfs is a 400.
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    # Prefix-cache blocks are shared only with requests of the same salt (non-empty).
    cache_salt: str | None = None
    # The reply carries its token ids (`token_ids`) and the prompt's (`prompt_token_ids`).
    return_token_ids: bool | None = None
    # Stop a reply stuck in a loop (upstream's RepetitionDetectionParams).
    repetition_detection: RepetitionDetectionRequest | None = None


# ---------------------------------------------------------------------------- completions


class CompletionRequest(SamplingRequestFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None


class CompletionLogProbs(ResponseModel):
    """Legacy completion logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    """One generated sequence of a completion (or a piece of it when streaming)."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With prompt_logprobs: None, then per prompt token {token id: {logprob, rank,
    # decoded_token}} (upstream's shape).
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    # With return_token_ids: the generated ids (a stream chunk's new ones) and the prompt's
    # (a stream sends them in the choice's first chunk).
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class PromptTokensDetails(ResponseModel):
    """Prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(ResponseModel):
    """Token counts of a request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(ResponseModel):
    """The body of a non-streaming completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(ResponseModel):
    """One server-sent event of a streaming completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------- chat


class ChatMessage(BaseModel):
    """One input message; content may be a string or a list of text parts."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    """A function the model may call: its name, what it does, its parameters' JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # Constrain every call of this function to `parameters` (with tool_choice "auto").
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    """One entry of `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(OpenAIBaseModel):
    """`{"name": ...}` of a named tool_choice."""

    name: str


class NamedToolChoice(OpenAIBaseModel):
    """A tool_choice that forces one function."""

    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingRequestFields):
    """POST /v1/chat/completions."""

    # The request's tool plan once made (serving_chat.tool_plan): never sent or received.
    _tool_plan: Any = PrivateAttr(default=None)
    _tool_plan_made: bool = PrivateAttr(default=False)

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[ChatTool] | None = None
    # "none", "auto", "required" (checked with the tools) or a named function.
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields with nothing to do here (README, "Coming from vLLM"): accepted, ignored.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching is automatic
    safety_identifier: str | None = None
    verbosity: str | None = None
    # Passed to the chat template as `reasoning_effort` (templates that know it use it).
    reasoning_effort: str | None = None
    # Upstream's image processor overrides for this request's images (min_pixels,
    # max_pixels; multimodal/processor_kwargs.py).
    mm_processor_kwargs: dict[str, Any] | None = None
    # OpenAI fields that would change the reply and that this engine does not implement: a
    # 400 naming them when set (modalities only when it asks for more than text).
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None


class TopLogprob(ResponseModel):
    """One alternative token at a position."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(ResponseModel):
    """A sampled token, its logprob and the most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(ResponseModel):
    """Chat logprobs: one entry per generated token."""

    content: list[TokenLogprob] | None = None


class ResponseMessage(ResponseModel):
    """The assistant's message in a chat response."""

    role: str = "assistant"
    content: str | None = None
    # The thinking before the answer, with --reasoning-parser (None without one), under
    # both names upstream has used.
    reasoning: str | None = None
    reasoning_content: str | None = None
    # {"id", "type": "function", "function": {"name", "arguments"}} per call; None (left out
    # of the JSON, as OpenAI leaves it out) when the reply made no call.
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler):
        body = handler(self)
        if body.get("tool_calls") is None:
            body.pop("tool_calls", None)
        return body


class ChatChoice(ResponseModel):
    """One generated reply of a chat completion."""

    index: int
    message: ResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With return_token_ids: the reply's token ids.
    token_ids: list[int] | None = None


class ChatCompletionResponse(ResponseModel):
    """The body of a non-streaming chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    # With prompt_logprobs (see CompletionChoice.prompt_logprobs).
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    # With return_token_ids: the prompt's token ids (the rendered conversation).
    prompt_token_ids: list[int] | None = None


class DeltaMessage(ResponseModel):
    """What a streaming chat chunk adds to a reply."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    # {"index", "id", "type", "function": {"name", "arguments"}}; after the first delta of
    # a call only "index" and new "function.arguments" text.
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        # OpenAI's deltas carry only what changed (no "role": null after the first chunk).
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(ResponseModel):
    """One reply's part of a streaming chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With return_token_ids: the token ids this chunk adds.
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(ResponseModel):
    """One server-sent event of a streaming chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    # With return_token_ids, in the first chunk: the prompt's token ids.
    prompt_token_ids: list[int] | None = None


# ---------------------------------------------------------------------------- tokenization


class TokenizeCompletionRequest(OpenAIBaseModel):
    """POST /tokenize with a text prompt (upstream vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    """POST /tokenize with chat messages, rendered by the chat template first."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The chat template writes any special tokens itself, so none are added by default.
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool | None = False
    # As in chat: the images are counted as this request's settings size them.
    mm_processor_kwargs: dict[str, Any] | None = None


class TokenizeResponse(ResponseModel):
    """The body of a /tokenize answer."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    """The body of a /detokenize answer."""

    prompt: str
