"""Plain records of what happened to a request, for metrics."""

from __future__ import annotations

from dataclasses import dataclass


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

    def on_tokens(self, num_tokens: int, now: float) -> float | None:
        """Records new tokens; returns the time to first token when these are the first."""
        if num_tokens <= 0:
            return None
        self.num_generation_tokens += num_tokens
        self.last_token_time = now
        if self.first_token_time is None:
            self.first_token_time = now
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
