"""Device-side feedback of sampled tokens into the next step's inputs.

Sampled ids stay on the device: the next step's input for a request whose newest token is not
on the host yet is copied from `last_token`, so building a step never waits for the previous
one (this is what makes async scheduling possible). Likewise a request verified with drafts
starts its next step after the tokens it kept, placed on the device from the verification's
kept count (`place_after_kept`). Both are kept per batch row, so they move with the rows.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm import _custom_ops as ops
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from vllm.v1.worker.input_buffers import InputBuffers
from vllm.v1.worker.input_prep import StepInputs


class DeviceFeedback:
    """Per batch row on the device: the newest sampled token, and (after a verification with
    drafts) the position where the row's next forward starts."""

    def __init__(
        self, max_num_reqs: int, block_size: int, buffers: InputBuffers, speculative: bool
    ) -> None:
        device = buffers.device
        self.buffers = buffers
        self.block_size = block_size
        # Only speculative decoding verifies drafts, so only it ever places inputs.
        self.speculative = speculative
        self.last_token = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.next_start = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)

    def move_row(self, src: int, dst: int) -> None:
        """Follows a batch row moved from src to dst (InputBatch.remove)."""
        self.last_token[dst] = self.last_token[src]
        self.next_start[dst] = self.next_start[src]

    def take_verified(self, batch: InputBatch, rows: list[int]) -> list[int]:
        """Indices into `rows` of the requests verified with drafts since their last forward;
        clears their marks (this forward places them)."""
        if not self.speculative:
            return []
        states = batch.states
        verified = [i for i, row in enumerate(rows) if states[row].verified_drafts]
        for i in verified:
            states[rows[i]].verified_drafts = False
        return verified

    def fill_unknown(self, input_ids: torch.Tensor, inputs: StepInputs) -> None:
        """Writes `last_token` of their rows into the staged input ids the host does not
        know (sampled by a step whose host copy has not been settled)."""
        unknown = np.nonzero(~inputs.known)[0]
        if len(unknown):
            src = self.buffers.to_device(inputs.req_indices[unknown].astype(np.int64))
            dst = self.buffers.to_device(unknown.astype(np.int64))
            input_ids[dst] = self.last_token[src]

    def place_after_kept(
        self,
        dev: dict[str, torch.Tensor],
        verified: list[int],
        inputs: StepInputs,
        reads_host_lengths: bool,
    ) -> None:
        """Moves the inputs of the requests `verified` (indices into this step's requests) to
        start just after the tokens they kept: positions, KV slots and sequence lengths in
        the staged device tensors `dev`.

        Under async scheduling such a request may be scheduled before the scheduler learns
        how many drafts it kept; its computed-token count then assumes all were (an upper
        bound, so its blocks suffice, and its first input, unknown to the host at that
        position, comes from `last_token`). The kept count is on the device as soon as the
        verification is sampled, so no step waits for its host copy (docs/architecture.md
        §11). On the CPU the staged tensors are the host arrays, which change with them; off
        the CPU, an attention backend that reads host lengths (`reads_host_lengths`) waits
        for the corrected ones, written into inputs.seq_lens. Raises RuntimeError (CPU only)
        when the kept tokens end past the scheduler's start.
        """
        to_device = self.buffers.to_device
        rows, cu, num_sched = inputs.rows_np, inputs.cu, inputs.num_sched
        seq_lens = inputs.seq_lens
        reqs = np.asarray(verified, dtype=np.int64)
        counts, firsts = num_sched[reqs], cu[reqs]
        # Token j of verified request k sits at flat index firsts[k] + j (its k in `owner`).
        owner = np.empty(int(counts.sum()), dtype=np.int32)
        flat = np.empty(len(owner), dtype=np.int64)
        ops.prepare_positions(firsts, counts, owner, flat)
        owner = owner.astype(np.int64)
        offsets = flat - firsts[owner]
        tokens = to_device(flat)
        start = self.next_start[to_device(rows[reqs].astype(np.int64))]
        if self.buffers.on_cpu:
            # The scheduler's start is an upper bound; beyond it the blocks may not be ours.
            # (Checked where it costs no device sync.)
            scheduled = seq_lens[reqs] - counts
            if (start.numpy() > scheduled).any():
                raise RuntimeError(
                    f"requests {[int(r) for r in rows[reqs]]}: kept tokens end at "
                    f"{start.tolist()}, past the scheduled starts {scheduled.tolist()}"
                )
        positions = start[to_device(owner)] + to_device(offsets)
        dev["positions"][tokens] = positions
        blocks = dev["block_table"][to_device(reqs[owner]), positions // self.block_size]
        dev["slot_mapping"][tokens] = (
            blocks.to(torch.int64) * self.block_size + positions % self.block_size
        )
        lengths = (start + to_device(counts)).to(dev["seq_lens"].dtype)
        dev["seq_lens"][to_device(reqs)] = lengths
        if reads_host_lengths and not self.buffers.on_cpu:
            seq_lens[reqs] = lengths.cpu().numpy()

    def write(
        self,
        batch: InputBatch,
        req_ids: list[str],
        states: list[CachedRequestState],
        token_ids: torch.Tensor,
        newest: torch.Tensor | None = None,
    ) -> None:
        """Writes sampled ids `token_ids` (one per request) into `last_token` at the requests'
        current rows, and `newest` (the position of each request's newest kept token, after a
        verification with drafts) into `next_start`.

        Rows are looked up now, not at execute time: a newer step executed in between may
        have moved a row (the last row fills a hole) or dropped a request that finished or
        was preempted. A dropped request needs no feedback; its token still reaches the
        engine, which keeps it (preempted) or drops it (finished).
        """
        rows: list[int] = []
        keep: list[int] = []
        for i, (req_id, state) in enumerate(zip(req_ids, states)):
            row = batch.req_id_to_index.get(req_id)
            if row is not None and batch.states[row] is state:
                rows.append(row)
                keep.append(i)
        if not rows:
            return
        if len(keep) < len(req_ids):
            kept = self.buffers.to_device(np.asarray(keep, dtype=np.int64))
            token_ids = token_ids[kept]
            newest = newest[kept] if newest is not None else None
        rows_dev = self.buffers.to_device(np.asarray(rows, dtype=np.int64))
        self.last_token.index_copy_(0, rows_dev, token_ids)
        if newest is not None:
            self.next_start.index_copy_(0, rows_dev, newest)
