"""A request's sampling parameters: the SamplingParams an OpenAI request's fields make (with
the model's generation-config defaults for what it leaves unset) and its structured-output
constraint from `response_format`, `structured_outputs` or the `guided_*` fields."""

from __future__ import annotations

from typing import Any

from vllm.entrypoints.openai.protocol import SamplingRequestFields
from vllm.exceptions import InvalidRequestError
from vllm.sampling_params import NO_CONSTRAINT_MESSAGE, SamplingParams, StructuredOutputsParams


def structured_outputs_params(request: SamplingRequestFields) -> StructuredOutputsParams | None:
    """Gathers the one output constraint of a request from every surface that can give it:
    response_format, the extra-body structured_outputs object, and the guided_* fields.

    Raises ValueError when two are given or one is malformed.
    """
    found: list[tuple[str, str, Any]] = []  # (where, constraint, value)
    options: dict[str, Any] = {}
    rf = request.response_format
    if rf is not None:
        if rf.type == "json_schema":
            schema = rf.json_schema.json_schema if rf.json_schema is not None else None
            if schema is None:
                raise InvalidRequestError(
                    "response_format.json_schema",
                    "a JSON schema object ('schema') is required"
                )
            found.append(("response_format", "json", schema))
        elif rf.type == "json_object":
            found.append(("response_format", "json_object", True))
        elif rf.type == "structural_tag":
            found.append(("response_format", "structural_tag", rf.model_dump(exclude_none=True)))
    structured_outputs = request.structured_outputs
    if structured_outputs is not None:
        data = structured_outputs.model_dump(by_alias=True)
        for key in (
            "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
            "max_whitespace", "backend", "fast_forward",
        ):
            options[key] = data.pop(key)
        for key, value in data.items():
            if value is not None and value is not False:
                found.append(("structured_outputs", key, value))
        if not any(where == "structured_outputs" for where, _, _ in found):
            raise InvalidRequestError("structured_outputs", NO_CONSTRAINT_MESSAGE)
    for field, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(request, field)
        if value is not None:
            found.append((field, key, value))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(
            where if where.startswith("guided_") else f"{where}.{key}" for where, key, _ in found
        )
        raise InvalidRequestError(
            "structured_outputs",
            f"only one output constraint may be given, got {names}"
        )
    _, key, value = found[0]
    if request.guided_decoding_backend is not None:
        if options.get("backend") not in (None, request.guided_decoding_backend):
            raise InvalidRequestError(
                "guided_decoding_backend", "conflicts with structured_outputs.backend"
            )
        options["backend"] = request.guided_decoding_backend
    return StructuredOutputsParams(**{key: value}, **options)


def sampling_params(
    request: SamplingRequestFields,
    max_tokens: int | None,
    logprobs: int | None,
    defaults: dict[str, Any],
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """SamplingParams of a request; `defaults` (the model's generation config) fill the
    sampling fields it leaves unset, and `structured_outputs` replaces its own constraint
    (tool calling brings one). Raises InvalidRequestError naming the bad field."""
    if request.stream_options is not None and not request.stream:
        raise InvalidRequestError("stream_options", "only allowed when stream is true")
    if request.guided_whitespace_pattern is not None:
        raise InvalidRequestError("guided_whitespace_pattern", "is not supported")
    try:
        return _build(request, max_tokens, logprobs, defaults, structured_outputs)
    except InvalidRequestError as e:
        # A chat request asks for a number of logprobs through top_logprobs (logprobs is
        # only its on/off switch), so that is the field a range error must name.
        if e.param == "logprobs" and getattr(request, "top_logprobs", None) is not None:
            raise InvalidRequestError("top_logprobs", e.message) from None
        raise

def _given_or_default(request: SamplingRequestFields, defaults: dict[str, Any], name: str,
                      fallback: Any) -> Any:
    """The request's value of a sampling field, else the model's generation-config
    default (--generation-config), else vLLM's."""
    value = getattr(request, name)
    if value is not None:
        return value
    return defaults.get(name, fallback)

def _build(
    request: SamplingRequestFields,
    max_tokens: int | None,
    logprobs: int | None,
    defaults: dict[str, Any],
    structured_outputs: StructuredOutputsParams | None,
) -> SamplingParams:
    """SamplingParams from the request's fields (raises what SamplingParams raises)."""
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and getattr(request, "echo", False) and logprobs is not None:
        prompt_logprobs = logprobs  # echo scores the prompt it echoes
    return SamplingParams(
        n=request.n,
        temperature=_given_or_default(request, defaults, "temperature", 1.0),
        top_p=_given_or_default(request, defaults, "top_p", 1.0),
        top_k=_given_or_default(request, defaults, "top_k", 0),
        min_p=_given_or_default(request, defaults, "min_p", 0.0),
        seed=request.seed,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=_given_or_default(request, defaults, "repetition_penalty", 1.0),
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        structured_outputs=structured_outputs or structured_outputs_params(request),
        logit_bias=getattr(request, "logit_bias", None) or None,
        allowed_token_ids=request.allowed_token_ids,
        bad_words=request.bad_words,
        prompt_logprobs=prompt_logprobs,
        repetition_detection=(request.repetition_detection.model_dump()
                              if request.repetition_detection is not None else None),
        thinking_token_budget=request.thinking_token_budget,
    )
