"""What the model runner returns to the engine core."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class LogprobsLists:
    """Per sampled row: [sampled token, top-k tokens...] ids and logprobs, and the sampled rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of one step, in the runner's batch order."""

    # Request ids in batch order.
    req_ids: list[str]
    # Sampled tokens per request (empty list for a partial prefill).
    sampled_token_ids: list[list[int]]
    # Logprobs per request index, or None when no request asked for them.
    logprobs: LogprobsLists | None = None
    # Request id -> (first prompt position, LogprobsLists of the prompt tokens that follow
    # it): the part of its prompt this step computed, for requests with prompt_logprobs.
    prompt_logprobs: dict[str, tuple[int, LogprobsLists]] | None = None
    # Request id -> why it cannot go on (its LoRA adapter failed to load in the worker): the
    # engine core ends it with that error; its tokens of this step are dropped.
    failed: dict[str, str] | None = None
    # EAGLE-3: request id -> the drafts the worker's head proposed after this step's tokens
    # (None: the method drafts elsewhere). The scheduler cuts and checks them (§11).
    draft_token_ids: dict[str, list[int]] | None = None


class AsyncModelRunnerOutput(ABC):
    """A ModelRunnerOutput whose device-to-host copy may still be in flight."""

    @abstractmethod
    def get_output(self) -> ModelRunnerOutput:
        """Waits for this step's copy only, then returns the output."""


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
