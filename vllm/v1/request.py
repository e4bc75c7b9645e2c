"""The engine core's view of one request."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.exceptions import ErrorKind
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import block_hash_salt
from vllm.v1.core.mm_block_keys import KeyedTokens
from vllm.v1.core.sched.repetition import RepetitionDetector

if TYPE_CHECKING:
    from vllm.multimodal.inputs import ImageFeature
    from vllm.reasoning.budget import ThinkingBudget
    from vllm.v1.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Values above PREEMPTED are finished."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # its grammar is still compiling
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Token state of one request inside the engine core (prompt, outputs, progress)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        mm_features: list[ImageFeature] | None = None,
    ) -> None:
        """`priority` orders it under --scheduling-policy priority (lower first);
        `cache_salt` keeps its prefix-cache blocks apart from those of other salts;
        `mm_features` are the prompt's images (their placeholders are in the prompt)."""
        self.request_id = request_id
        # The adapter the request runs with (None: the base model).
        self.lora_request = lora_request
        self.priority = priority
        self.cache_salt = cache_salt
        # The parent hash of its first KV block: requests share prefix-cache blocks only
        # when their adapters and cache salts agree.
        self.block_hash_salt = block_hash_salt(
            lora_request.cache_salt if lora_request is not None else None, cache_salt
        )
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        # Prompt + confirmed outputs. Under async scheduling tokens still being sampled are
        # not here; they are counted in num_output_placeholders.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.mm_features = mm_features or None
        # What prefix-cache block hashes read: the tokens, with the images' content in
        # place of their placeholders (mm_block_keys.py).
        self.block_hash_tokens: Sequence[int] = (
            KeyedTokens(self.all_token_ids, self.mm_features) if self.mm_features
            else self.all_token_ids
        )
        # Tokens whose KV is in the cache (or scheduled to be, within the current step).
        # While a verification is in flight it assumes every draft is kept; its output
        # takes back the rejected ones.
        self.num_computed_tokens = 0
        # Tokens scheduled for sampling whose values the scheduler has not seen yet (with
        # drafts in flight, the most a verification can keep).
        self.num_output_placeholders = 0
        # Drafts of the request's newest scheduled step (async scheduling: it drafts next
        # from them before that step's output arrives).
        self.spec_token_ids: list[int] = []
        # Whether the newest verification whose output arrived kept all its drafts.
        self.kept_all_drafts = True
        # Tokens of all_token_ids the model runner has been given (the prompt when new, every
        # token when resumed, new tokens under pipeline parallelism: SchedulerOutput).
        self.num_tokens_sent = 0
        self.num_preemptions = 0
        # prompt_logprobs: prompt position -> (ids, logprobs, rank) as computed so far, sent
        # with the first output (a recompute after preemption overwrites, never duplicates).
        self.prompt_logprobs: dict[int, tuple[list[int], list[float], int]] = {}
        self.prompt_logprobs_sent = False
        # Prompt tokens served from the prefix cache at first admission.
        self.num_cached_tokens = 0
        # When the scheduler first scheduled it (time.monotonic()), carried by its next output
        # for the queue-time metrics; None until then, and once sent.
        self.first_scheduled_time: float | None = None
        self.first_scheduled_sent = False
        # Why a stopped request stopped: the stop token id or stop string, if any.
        self.stop_reason: int | str | None = None
        # Human-readable cause for FINISHED_ERROR.
        self.error_message: str | None = None
        # Whose fault FINISHED_ERROR was (see ErrorKind); set with error_message.
        self.error_kind: ErrorKind | None = None
        # Set by the scheduler when sampling_params.thinking_token_budget is set.
        self.thinking_budget: ThinkingBudget | None = None
        # Watches the outputs for a loop (sampling_params.repetition_detection), else None.
        repetition = sampling_params.repetition_detection
        self.repetition_detector = (
            RepetitionDetector(repetition) if repetition is not None and repetition.enabled
            else None
        )
        self.structured_output_request: StructuredOutputRequest | None = None
        if sampling_params.structured_outputs is not None:
            from vllm.v1.structured_output.request import StructuredOutputRequest

            self.structured_output_request = StructuredOutputRequest(
                sampling_params.structured_outputs
            )
        self.status = (
            RequestStatus.WAITING_FOR_FSM
            if self.structured_output_request is not None
            else RequestStatus.WAITING
        )

    @property
    def num_tokens(self) -> int:
        """Confirmed tokens: prompt plus sampled outputs the scheduler has seen."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        """Appends sampled tokens to the outputs and the full token list."""
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return self.status.finished

    def get_finish_reason(self) -> str | None:
        return self.status.finish_reason
