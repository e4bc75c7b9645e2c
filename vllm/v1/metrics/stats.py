"""Plain records of what happened to a request, for metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RequestStateStats:
    """Timing of one live request in the API server (times from time.monotonic())."""

    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Summed over the request's n sequences.
    num_generation_tokens: int = 0
    num_seqs: int = 1
    # When the engine core first scheduled the request (same clock; None until known).
    first_scheduled_time: float | None = None
    # The most tokens each sequence may generate (the request's max_tokens, or what the
    # context leaves when it has none); None when unknown.
    max_tokens: int | None = None
    # The data-parallel engine serving the request (0 with one engine): the `engine` label
    # of its metrics.
    engine_index: int = 0

    def on_scheduled(self, when: float) -> None:
        """Records the engine's first-scheduled time (the earliest of the n sequences), kept
        between arrival and now so a skewed clock cannot make a time negative."""
        if self.first_scheduled_time is None or when < self.first_scheduled_time:
            self.first_scheduled_time = max(self.arrival_time, when)

    def on_tokens(self, num_tokens: int, now: float) -> float | None:
        """Records new tokens; returns the time to first token when these are the first."""
        if num_tokens <= 0:
            return None
        self.num_generation_tokens += num_tokens
        self.last_token_time = now
        if self.first_token_time is None:
            self.first_token_time = now
            if self.first_scheduled_time is None or self.first_scheduled_time > now:
                # No engine timestamp (an engine that does not send one): prefill is then
                # counted from arrival, queue time as zero.
                self.first_scheduled_time = min(now, self.first_scheduled_time or self.arrival_time)
            return now - self.arrival_time
        return None

    def finish(self, finish_reason: str, now: float) -> FinishedRequestStats:
        """The record of this request ending now with `finish_reason`."""
        tpot = None
        # Sequences of one request decode side by side: time per token of one sequence.
        per_seq = self.num_generation_tokens / max(1, self.num_seqs)
        if self.first_token_time is not None and self.last_token_time is not None and per_seq > 1:
            tpot = (self.last_token_time - self.first_token_time) / (per_seq - 1)
        return FinishedRequestStats(
            finish_reason=finish_reason,
            e2e_latency=now - self.arrival_time,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            mean_time_per_output_token=tpot,
            n=self.num_seqs,
            max_tokens=self.max_tokens,
            engine_index=self.engine_index,
            queue_time=(
                None if self.first_scheduled_time is None
                else self.first_scheduled_time - self.arrival_time
            ),
            prefill_time=(
                None if self.first_scheduled_time is None or self.first_token_time is None
                else self.first_token_time - self.first_scheduled_time
            ),
            decode_time=(
                None if self.first_token_time is None or self.last_token_time is None
                else self.last_token_time - self.first_token_time
            ),
            inference_time=(
                None if self.first_scheduled_time is None or self.last_token_time is None
                else self.last_token_time - self.first_scheduled_time
            ),
        )


@dataclass
class FinishedRequestStats:
    """One finished (or aborted) request."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    # None when fewer than two tokens were generated.
    mean_time_per_output_token: float | None
    # Arrival to first schedule, first schedule to first token, first to last token; None
    # when the request ended before that phase began (an abort while waiting).
    queue_time: float | None = None
    prefill_time: float | None = None
    decode_time: float | None = None
    # First schedule to last token (prefill and decode together); None without a token.
    inference_time: float | None = None
    # The request's sampling parameters n and max_tokens (None: unknown).
    n: int = 1
    max_tokens: int | None = None
    # The data-parallel engine that served it.
    engine_index: int = 0


def effective_max_tokens(params: Any, num_prompt_tokens: int, max_model_len: int) -> int:
    """The most tokens each sequence of a request may generate: its SamplingParams'
    max_tokens, or, when that is None, what the context leaves after the prompt."""
    if params.max_tokens is not None:
        return params.max_tokens
    return max(0, max_model_len - num_prompt_tokens)
