"""Persistent batch: per-request state in preallocated arrays, updated incrementally each step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import ImageFeature
from vllm.sampling_params import SamplingParams

# How the runner stores the sampling parameters it puts in columns (see
# SamplingInputs.build); the engine core admits only values that fit them
# (vllm/v1/engine/validation.py, by sampling_params.INT_FIELD_BOUNDS and FLOAT32_FIELDS).
TOP_K_DTYPE = np.int32
SAMPLING_FLOAT_DTYPE = np.float32


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
    # The prompt's images (None: text only), and their M-RoPE positions once the runner
    # has built them (prompt table [3, prompt_len], delta of later tokens).
    mm_features: list[ImageFeature] | None = None
    mrope: tuple[np.ndarray, int] | None = None


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
