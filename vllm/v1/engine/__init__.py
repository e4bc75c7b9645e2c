"""Typed messages between the front end (LLM / AsyncLLM) and the engine core."""

from __future__ import annotations

import msgspec

from vllm.exceptions import ErrorKind
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import ImageFeature
from vllm.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A validated, tokenized request entering the engine core."""

    request_id: str
    prompt_token_ids: list[int]
    # Decoding it in the engine-core process runs SamplingParams' own checks again, so the
    # core never holds values that a SamplingParams could not have been built with.
    sampling_params: SamplingParams
    arrival_time: float
    # The adapter the request runs with (None: the base model).
    lora_request: LoRARequest | None = None
    # Its place under --scheduling-policy priority (lower first; 0 under fcfs).
    priority: int = 0
    # Prefix-cache blocks are shared only among requests of the same salt (None: no salt).
    cache_salt: str | None = None
    # The prompt's images, in prompt order (None: text only).
    mm_features: list[ImageFeature] | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens (and maybe the end) of one request after one step."""

    request_id: str
    new_token_ids: list[int]
    # Per new token: [sampled, top-k...] ids and logprobs, and the sampled token's rank.
    new_logprobs_token_ids: list[list[int]] | None = None
    new_logprobs: list[list[float]] | None = None
    new_logprobs_ranks: list[int] | None = None
    finish_reason: str | None = None
    # Stop token id that ended the request, if any.
    stop_reason: int | str | None = None
    # Why a request ended with finish_reason "error".
    error: str | None = None
    # Prompt tokens served from the prefix cache (set on the first output).
    num_cached_tokens: int = 0
    # With finish_reason "error": whose fault it was, decided where the error was found
    # (the server maps it to an HTTP status; the message is for people only).
    error_kind: ErrorKind | None = None
    # With prompt_logprobs, on the first output: per prompt token after the first,
    # ([the token, top-k...] ids, their logprobs, the token's rank).
    prompt_logprobs: list[tuple[list[int], list[float], int]] | None = None
    # time.monotonic() in the engine-core process when the request was first scheduled, set on
    # its first output only (for the queue and prefill time histograms; CLOCK_MONOTONIC is
    # system-wide, so the API server on the same host can compare it with its own clock).
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Everything one engine step produced."""

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    # The data-parallel engine that sent them (set by the -dp client on arrival; 0 with one
    # engine): the `engine` label of their requests' metrics.
    engine_index: int = 0
