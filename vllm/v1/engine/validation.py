"""Every rule a request must pass before it is admitted, in one place.

The front end (`InputProcessor`, which both the offline `LLM` and the server's `AsyncLLM`
use) and the engine core call the same functions here, so a request the server refuses is
refused offline too, with the same message. Each rule raises `InvalidRequestError` naming
the field; the server answers it with a 400, and the engine core ends the request with
`ErrorKind.INVALID_REQUEST` (also a 400). Rules about one parameter's own value (ranges,
list sizes) live in `SamplingParams.verify`; the rules here need the model or the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm.config import LoRAConfig
from vllm.exceptions import InvalidRequestError
from vllm.lora.request import check_lora_enabled
from vllm.options import PRIORITY
from vllm.sampling_params import SamplingParams, StructuredOutputsParams, check_numeric_fields

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_num_sequences(num_prompts: int, n: int, max_n: int) -> None:
    """Raises InvalidRequestError when `num_prompts` prompts times `n` samples exceed
    `max_n` (--max-n)."""
    if num_prompts * n > max_n:
        what = f"n={n}" if num_prompts == 1 else f"{num_prompts} prompts x n={n}"
        raise InvalidRequestError(
            "n",
            f"{what} asks for {num_prompts * n} sequences; this server allows at most "
            f"{max_n} per request (--max-n)"
        )


def check_prompt(prompt_token_ids: Sequence[Any], vocab_size: int, max_model_len: int) -> None:
    """Raises InvalidRequestError unless the prompt is a non-empty list of integer token ids
    in [0, vocab_size) that leaves room for at least one generated token."""
    if len(prompt_token_ids) == 0:
        raise InvalidRequestError("prompt", "must not be empty")
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequestError(
            "prompt",
            f"{len(prompt_token_ids)} tokens leave no room to generate within "
            f"max_model_len ({max_model_len})"
        )
    if not all(_is_int(t) for t in prompt_token_ids):
        raise InvalidRequestError("prompt_token_ids", "token ids must be integers")
    low, high = min(prompt_token_ids), max(prompt_token_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InvalidRequestError(
            "prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})"
        )


def check_fits(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Raises InvalidRequestError when the prompt plus `max_tokens` exceeds `max_model_len`.

    Without `max_tokens` a request generates until the context is full, so it always fits.
    Checked at admission only: the engine core does not need it (its scheduler never runs a
    request past `max_model_len`), it is what the caller was promised.
    """
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(
            "max_tokens",
            f"this model's maximum context length is {max_model_len} tokens; the "
            f"prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}, "
            f"{num_prompt_tokens + max_tokens} in all"
        )


def check_priority(priority: object, policy: str) -> None:
    """Raises InvalidRequestError naming `priority` unless it is an int64 integer, and unless
    it is 0 when the scheduling policy is not "priority" (fcfs would ignore it silently)."""
    if not _is_int(priority) or not _INT64_MIN <= priority <= _INT64_MAX:  # type: ignore[operator]
        raise InvalidRequestError("priority", f"must be an int64 integer, got {priority!r}")
    if priority != 0 and policy != PRIORITY:
        raise InvalidRequestError(
            "priority",
            f"is {priority}, but this engine schedules first come first served: start it "
            "with --scheduling-policy priority (LLM(scheduling_policy=\"priority\")) to "
            "order requests by priority",
        )


def check_cache_salt(cache_salt: object) -> None:
    """Raises InvalidRequestError naming `cache_salt` unless it is None (no salt) or a
    non-empty string."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidRequestError("cache_salt", "must be a non-empty string when given")


def check_stop_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raises InvalidRequestError when a stop token id is outside [0, vocab_size): the
    model can never sample it, so the caller surely meant another id."""
    bad = [t for t in params.stop_token_ids or () if not _is_int(t) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            "stop_token_ids", f"{bad[0]} is outside the vocabulary [0, {vocab_size})"
        )


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raises InvalidRequestError naming the field when logit_bias, allowed_token_ids or
    bad_words_token_ids holds a token id outside [0, vocab_size), or allowed_token_ids
    holds more ids than the vocabulary.

    The sampler indexes the logits with these ids: one outside the vocabulary would fail
    the whole step, not just this request.
    """
    allowed = params.allowed_token_ids or []
    if len(allowed) > vocab_size:
        # More ids than the vocabulary has must repeat some; refused before any is scanned.
        raise InvalidRequestError(
            "allowed_token_ids", f"at most {vocab_size} ids (the vocabulary), got {len(allowed)}")
    groups = {
        "logit_bias": list(params.logit_bias or ()),
        "allowed_token_ids": params.allowed_token_ids or [],
        "bad_words": [t for seq in params.bad_words_token_ids or () for t in seq],
    }
    for name, ids in groups.items():
        bad = [t for t in ids if not _is_int(t) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                name, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
            )


def check_stored_params(params: SamplingParams, vocab_size: int) -> None:
    """Raises InvalidRequestError when a value of `params` (possibly changed after it was
    built and verified) could not be held by the model runner: a number outside its
    column's dtype, more logprobs than the vocabulary, a stop id outside int64, or a
    constraint that is not a StructuredOutputsParams."""
    check_numeric_fields(params)
    _check_stored_values(params, vocab_size)


def _check_stored_values(params: SamplingParams, vocab_size: int) -> None:
    """check_stored_params past the numeric fields' dtypes."""
    if params.logprobs is not None and not 0 <= params.logprobs <= vocab_size:
        raise InvalidRequestError(
            "logprobs", f"must be in [0, {vocab_size}], got {params.logprobs}"
        )
    # Only compared with sampled ids, never used as an index: the storage bound suffices.
    for name in ("stop_token_ids", "all_stop_token_ids"):
        ids = getattr(params, name)
        if any(not _is_int(t) or not _INT64_MIN <= t <= _INT64_MAX for t in ids):
            raise InvalidRequestError(name, "must be integers in the int64 range")
    constraint = params.structured_outputs
    if constraint is not None and not isinstance(constraint, StructuredOutputsParams):
        raise InvalidRequestError(
            "structured_outputs",
            f"must be StructuredOutputsParams, got {type(constraint).__name__}",
        )


def check_runner_inputs(
    prompt_token_ids: Sequence[Any], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """Raises InvalidRequestError unless the model runner can hold every input of one
    request: the prompt, each parameter in its column's dtype, and every token id the
    sampler indexes the logits with.

    The runner converts all rows of a step together, so one value it cannot store would
    fail the step and, with it, every request in the batch.
    """
    check_prompt(prompt_token_ids, vocab_size, max_model_len)
    check_stored_params(params, vocab_size)
    check_token_ids(params, vocab_size)


def check_engine_request(
    prompt_token_ids: Sequence[Any],
    params: SamplingParams,
    lora_request: object,
    vocab_size: int,
    max_model_len: int,
    lora_config: LoRAConfig | None,
) -> None:
    """The engine core's admission check, run on every request it admits, whoever sent it.

    The front end has checked all of this already; the engine core checks again because
    its requests may come from elsewhere (a client on the wire, engine-side code changing
    a field), and one bad value must fail its request alone, not a shared step.
    Raises InvalidRequestError naming the first offending input.
    """
    check_lora_enabled(lora_request, lora_config)
    params.verify()  # the numeric fields' dtypes and ranges
    check_prompt(prompt_token_ids, vocab_size, max_model_len)
    _check_stored_values(params, vocab_size)
    check_token_ids(params, vocab_size)
