"""Persistent batch: per-request state in preallocated arrays, updated incrementally each step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm.exceptions import InvalidRequestError
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams, check_numeric_fields, check_token_ids

# How the runner stores the sampling parameters it puts in columns (see
# SamplingInputs.build); the bounds every value is checked against at admission
# are sampling_params.INT_FIELD_BOUNDS and FLOAT32_FIELDS.
TOP_K_DTYPE = np.int32
SAMPLING_FLOAT_DTYPE = np.float32
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_request_inputs(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
) -> None:
    """Checks that one request's inputs fit the runner's storage and limits.

    The runner converts all rows of a step together, so a single value it cannot store (an
    int32 top_k of 2**31, a token id outside the embedding) would fail the whole step and,
    with it, the engine. The engine core calls this before admitting a request, so that
    such a request fails alone. Raises ValueError naming the offending input.
    """
    if len(prompt_token_ids) == 0:
        raise InvalidRequestError("prompt", "must not be empty")
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequestError(
            "prompt",
            f"{len(prompt_token_ids)} tokens leave no room to generate within "
            f"max_model_len ({max_model_len})"
        )
    if not all(_is_int(t) for t in prompt_token_ids):
        raise InvalidRequestError("prompt", "token ids must be integers")
    low, high = min(prompt_token_ids), max(prompt_token_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InvalidRequestError(
            "prompt",
            f"token id {bad} is outside the vocabulary [0, {vocab_size})"
        )
    check_numeric_fields(params)
    if params.logprobs is not None and not 0 <= params.logprobs <= vocab_size:
        raise InvalidRequestError(
            "logprobs",
            f"must be in [0, {vocab_size}], got {params.logprobs}"
        )
    for name in ("stop_token_ids", "all_stop_token_ids"):
        ids = getattr(params, name)
        if any(not _is_int(t) or not _INT64_MIN <= t <= _INT64_MAX for t in ids):
            raise InvalidRequestError(name, "must be integers in the int64 range")
    # The sampler indexes the logits with these: one id outside the vocabulary would fail
    # the whole step.
    check_token_ids(params, vocab_size)


@dataclass
class CachedRequestState:
    """What the runner remembers about a request between steps (also while preempted)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Confirmed output token values; the newest ones may still be on the device (see
    # GPUModelRunner._settle), so use num_output_tokens for counting.
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens this runner has sampled for the request (confirmed or not).
    num_output_tokens: int = 0
    # Set by a verification with drafts, until the request's next forward: the scheduler
    # may have scheduled that forward assuming every draft was kept.
    verified_drafts: bool = False
    # The adapter the request runs with (None: the base model).
    lora_request: LoRARequest | None = None


class InputBatch:
    """Rows 0..num_reqs-1 hold the requests the runner is currently stepping.

    Rows stay dense: removing a request moves the last row into the hole, so a step's batch
    order is the row order.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks = -(-max_model_len // block_size)
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_known_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, self.max_num_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self.states: list[CachedRequestState] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add(self, state: CachedRequestState) -> int:
        """Appends a request as the last row; returns its row index."""
        row = len(self.req_ids)
        if row >= self.max_num_reqs:
            raise RuntimeError("persistent batch is full (scheduler exceeded max_num_seqs)")
        self.req_ids.append(state.req_id)
        self.states.append(state)
        self.req_id_to_index[state.req_id] = row
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_known_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, state.block_ids)
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        """Extends a row's block table."""
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        """Records confirmed output token values for a row."""
        start = self.num_known_tokens[row]
        self.token_ids[row, start : start + len(token_ids)] = token_ids
        self.num_known_tokens[row] = start + len(token_ids)

    def remove(self, req_id: str) -> tuple[int, int] | None:
        """Drops a request; returns (moved_from, moved_to) if the last row filled its hole."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        last = len(self.req_ids) - 1
        moved = None
        if row != last:
            self.req_ids[row] = self.req_ids[last]
            self.states[row] = self.states[last]
            self.req_id_to_index[self.req_ids[row]] = row
            n = self.num_known_tokens[last]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            self.num_known_tokens[row] = n
            self.num_computed_tokens[row] = self.num_computed_tokens[last]
            nb = self.num_blocks[last]
            self.block_table[row, :nb] = self.block_table[last, :nb]
            self.num_blocks[row] = nb
            moved = (last, row)
        self.req_ids.pop()
        self.states.pop()
        return moved
