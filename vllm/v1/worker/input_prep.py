"""Host-side inputs of one step: the flat varlen arrays the runner stages onto the device.

Every array is built on the host from the persistent batch and the scheduler output; tokens
the host does not know yet (sampled by a step whose copy is still in flight) are marked in
`known` and filled on the device later (DeviceFeedback).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm import _custom_ops as ops
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.worker.cuda_graph import DecodeGraphs
from vllm.v1.worker.gpu_input_batch import InputBatch


@dataclass
class StepInputs:
    """One step's host arrays. Arrays past num_tokens / num_reqs are padding (graph replays,
    or the CPU's minimum row count)."""

    rows: list[int]  # batch rows of the scheduled requests, batch order
    req_ids: list[str]
    num_sched: np.ndarray  # [num_reqs] int32: tokens scheduled per request
    starts: np.ndarray  # [num_reqs] int32: computed tokens before this step
    req_indices: np.ndarray  # [num_tokens] int32: the batch row of each token
    known: np.ndarray  # [num_tokens] bool: whether the host knows the token's id
    drafts: list[list[int]] | None  # per request, the drafts it verifies (None: no spec)
    graph_size: int | None  # the captured decode graph to replay, if any
    token_ids: np.ndarray  # [padded_tokens] int64
    positions: np.ndarray  # [padded_tokens] int64
    slot_mapping: np.ndarray  # [padded_tokens] int64, -1 for padding
    cu: np.ndarray  # [padded_reqs + 1] int32: query_start_loc
    seq_lens: np.ndarray  # [padded_reqs] int32
    block_table: np.ndarray  # [padded_reqs, max blocks] int32

    @property
    def num_reqs(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return int(self.num_sched.sum())

    @property
    def padded_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def rows_np(self) -> np.ndarray:
        return np.asarray(self.rows, dtype=np.int32)

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays InputBuffers.stage copies to the device, by buffer name."""
        return {
            "input_ids": self.token_ids,
            "positions": self.positions,
            "slot_mapping": self.slot_mapping,
            "query_start_loc": self.cu,
            "seq_lens": self.seq_lens,
            "block_table": self.block_table,
        }


def prepare(
    batch: InputBatch,
    scheduler_output: SchedulerOutput,
    block_size: int,
    graphs: DecodeGraphs | None,
    min_rows: int,
) -> StepInputs:
    """Builds the host arrays of a step with at least one scheduled token. A decode-only
    batch that a captured graph holds is padded to that graph's size; otherwise the token
    arrays are padded to min_rows. Reads the batch, changes nothing."""
    scheduled = scheduler_output.num_scheduled_tokens
    rows = [r for r, req_id in enumerate(batch.req_ids) if req_id in scheduled]
    req_ids = [batch.req_ids[r] for r in rows]
    rows_np = np.asarray(rows, dtype=np.int32)
    num_sched = np.asarray([scheduled[r] for r in req_ids], dtype=np.int32)
    starts = batch.num_computed_tokens[rows_np]
    num_reqs, num_tokens = len(rows), int(num_sched.sum())
    graph_size = None
    if graphs is not None and num_tokens == num_reqs:
        graph_size = graphs.padded_size(num_reqs)
    padded_tokens = graph_size or max(num_tokens, min_rows)
    padded_reqs = graph_size or num_reqs

    local_idx = np.empty(num_tokens, dtype=np.int32)
    positions = np.zeros(padded_tokens, dtype=np.int64)
    ops.prepare_positions(starts, num_sched, local_idx, positions[:num_tokens])
    req_indices = rows_np[local_idx]
    known = positions[:num_tokens] < batch.num_known_tokens[req_indices]
    token_ids = np.zeros(padded_tokens, dtype=np.int64)
    token_ids[:num_tokens] = np.where(
        known, batch.token_ids[req_indices, np.where(known, positions[:num_tokens], 0)], 0
    )
    cu = np.full(padded_reqs + 1, num_tokens, dtype=np.int32)
    cu[0] = 0
    np.cumsum(num_sched, out=cu[1 : num_reqs + 1])
    spec = scheduler_output.scheduled_spec_decode_tokens
    drafts = [spec.get(r, []) for r in req_ids] if spec else None
    if drafts is not None:
        _place_drafts(drafts, cu, token_ids, known)
    slot_mapping = np.full(padded_tokens, -1, dtype=np.int64)
    ops.compute_slot_mapping(
        batch.block_table, req_indices, positions[:num_tokens], block_size,
        slot_mapping[:num_tokens],
    )
    # Padded requests (graph replays) own no query tokens and no context (cu above).
    seq_lens = np.zeros(padded_reqs, dtype=np.int32)
    seq_lens[:num_reqs] = starts + num_sched
    block_table = np.zeros((padded_reqs, batch.max_num_blocks), dtype=np.int32)
    block_table[:num_reqs] = batch.block_table[rows_np]
    return StepInputs(
        rows=rows, req_ids=req_ids, num_sched=num_sched, starts=starts,
        req_indices=req_indices, known=known, drafts=drafts, graph_size=graph_size,
        token_ids=token_ids, positions=positions, slot_mapping=slot_mapping, cu=cu,
        seq_lens=seq_lens, block_table=block_table,
    )


def _place_drafts(
    drafts: list[list[int]], cu: np.ndarray, token_ids: np.ndarray, known: np.ndarray
) -> None:
    # Drafts follow the request's one regular token, at the end of its segment.
    for i, tokens in enumerate(drafts):
        if tokens:
            end = int(cu[i + 1])
            token_ids[end - len(tokens) : end] = tokens
            known[end - len(tokens) : end] = True
