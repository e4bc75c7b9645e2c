"""What the scheduler tells the model runner each step, and the grammar bitmask for it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import ImageFeature
from vllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen yet (first schedule)."""

    # The request's id.
    req_id: str
    # Prompt token ids.
    prompt_token_ids: list[int]
    # Sampling parameters (the runner reads seeds, penalties, logprobs, min_tokens from them).
    sampling_params: SamplingParams
    # Physical KV block ids the request owns, in order.
    block_ids: list[int]
    # Tokens already in the KV cache (prefix-cache hit) before this step.
    num_computed_tokens: int
    # The adapter the request runs with (None: the base model).
    lora_request: LoRARequest | None = None
    # The prompt's images (None: text only); the runner keeps them while the request
    # lives, preempted or not.
    mm_features: list[ImageFeature] | None = None


@dataclass
class CachedRequestData:
    """Requests the runner has seen before, as parallel lists (one entry per request)."""

    # Request ids.
    req_ids: list[str] = field(default_factory=list)
    # True where the request was preempted and is scheduled again: the runner rebuilds it.
    resumed_from_preemption: list[bool] = field(default_factory=list)
    # Block ids appended to the request this step (a resumed request gets all of its blocks).
    new_block_ids: list[list[int]] = field(default_factory=list)
    # Tokens in the KV cache before this step.
    num_computed_tokens: list[int] = field(default_factory=list)
    # Every known token (prompt + outputs) of a resumed request, keyed by id; others are absent.
    resumed_req_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Output tokens generated so far by a resumed request (the runner needs them for penalties).
    resumed_num_output_tokens: dict[str, int] = field(default_factory=dict)
    # Pipeline parallelism only: output tokens the workers have not been told about, keyed by
    # id. There the workers learn a request's tokens from here rather than from their own
    # samples, since the first stage never sees a sample (docs/architecture.md §10).
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)

    def add(self, req_id: str, block_ids: list[int], num_computed_tokens: int,
            resumed: bool = False) -> None:
        """Appends one request's entry to the parallel lists (the resumed-only dicts are the
        caller's to fill)."""
        self.req_ids.append(req_id)
        self.resumed_from_preemption.append(resumed)
        self.new_block_ids.append(block_ids)
        self.num_computed_tokens.append(num_computed_tokens)


@dataclass
class SchedulerOutput:
    """One step: which requests run and how many tokens each computes."""

    # Requests scheduled for the first time.
    scheduled_new_reqs: list[NewRequestData]
    # Requests scheduled before (running, or resumed after preemption).
    scheduled_cached_reqs: CachedRequestData
    # Tokens to compute this step per request id (new + cached).
    num_scheduled_tokens: dict[str, int]
    # Sum of num_scheduled_tokens.
    total_num_scheduled_tokens: int
    # Requests finished or aborted since the previous step: the runner drops their state.
    finished_req_ids: set[str]
    # Requests preempted this step: the runner drops their state until they are resumed.
    preempted_req_ids: set[str] = field(default_factory=set)
    # True when any scheduled request has a grammar (a bitmask may be needed).
    has_structured_output_requests: bool = False
    # True when a scheduled structured request still waits for a token of an in-flight step,
    # so its bitmask (and sampling) must wait for that step's update_from_output.
    pending_structured_output_tokens: bool = False
    # Requests whose token this step is sampled (prefill finished or decoding), in batch order
    # of scheduling. Partial prefills are absent.
    sampled_req_ids: list[str] = field(default_factory=list)
    # Speculative decoding: requests whose trailing blocks (slots of rejected drafts) were
    # freed since the previous step, by id: keep only this many of their block ids. Applied
    # before this step's new_block_ids.
    num_kept_blocks: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: drafted tokens per request id (absent: none). The request's
    # num_scheduled_tokens counts them after its one regular token; the runner verifies them
    # and samples one token past the last accepted one (docs/architecture.md §11).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Grammar fast-forward: how many of a request's drafts (the first ones) its grammar
    # forced (absent: none). Canonical mode pins their bitmask rows to them; the stats
    # count them.
    num_forced_tokens: dict[str, int] = field(default_factory=dict)
    # Grammar fast-forward: how many of a request's drafts (the first ones, among the forced
    # ones) are each the only token their position allows (absent: none). They are
    # certain: the runner computes no logits, bitmask row or sample for their positions
    # and keeps them as they are.
    num_fast_forward_tokens: dict[str, int] = field(default_factory=dict)
    # EAGLE-3: requests whose drafts are placeholders (they were scheduled while a step of
    # theirs was in flight): the runner puts its own newest drafts for them in their place.
    worker_drafts: set[str] = field(default_factory=set)
    # Monotonic step counter (debugging and batch-queue bookkeeping).
    step_id: int = 0


@dataclass
class GrammarOutput:
    """Token bitmasks for the constrained requests of one step."""

    # Constrained request ids, one per bitmask row, in this order. A request with drafts
    # has one row per verified position: its id repeats on consecutive rows.
    structured_output_request_ids: list[str]
    # int32 [len(ids), ceil(vocab_size / 32)]: bit j of word w allows token 32 * w + j.
    grammar_bitmask: np.ndarray
