"""What the offline API returns."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from vllm.exceptions import ErrorKind
from vllm.logprobs import Logprob, SampleLogprobs


class OutputKind(enum.Enum):
    """What a request's outputs carry while it runs."""

    # After every step, everything generated so far.
    CUMULATIVE = "cumulative"
    # After every step, only what is new since the last output (streaming).
    DELTA = "delta"
    # One output, when the request finishes: nothing is built, and without stop strings
    # nothing is detokenized, before then.
    FINAL_ONLY = "final_only"


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # Per token: {token id: Logprob} for the sampled token and the top-k alternatives.
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Set when finish_reason is "error": the message, and whose fault it was (callers
    # decide by the kind, never by the message's text).
    error: str | None = None
    error_kind: ErrorKind | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its generated sequences so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # With prompt_logprobs: None for the first prompt token (nothing predicts it), then per
    # prompt token {token id: Logprob} for it and the top-k alternatives.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
