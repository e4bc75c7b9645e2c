"""Per-request device state that lets the post-layer function apply penalties in a graph.

Presence, frequency and repetition penalties read which tokens a request has seen: its prompt
and its output, the newest of which are still on the device under async scheduling. Sent
each step, those lists change shape with every request and token. Here each penalized
request owns a row (a slot) of two device tables instead: the count of each token in its
output, and whether the token is in its prompt. The post-layer function gathers the step's
slots, applies the penalties with fixed-shape operations, and after sampling adds each
row's new token to its count, so a decode step keeps the table current inside its graph.

The host remembers how many output tokens each slot has counted. When that is not the
request's output length (a new request, a step sampled on the eager path, drafts kept), the
slot is rebuilt from the request's tokens before the step, outside the graph: a few device
operations whose shapes follow the request, which never wait for the device.

Memory: (max rows + 1) x (vocabulary + 1) x 5 bytes (a float32 count and a bool); the last
row is a spare that padding and unpenalized rows read, and the last column absorbs padding
ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from vllm.v1.sample.ops.penalties import pad_token_lists
from vllm.v1.worker.gpu_input_batch import CachedRequestState

# (prompt ids [n, Lp] padded with the vocabulary size on the device, output ids on the
# host, output ids still on the device [n, P] or None): what SamplingInputs.penalty_history
# returns for a list of requests.
History = Callable[
    [list[CachedRequestState]], tuple[torch.Tensor, list[list[int]], torch.Tensor | None]
]


class PenaltyTable:
    """The per-slot token counts and prompt sets (see module docstring)."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.spare = max_rows
        self.counts = torch.zeros((max_rows + 1, vocab_size + 1), dtype=torch.float32,
                                  device=device)
        self.prompt = torch.zeros((max_rows + 1, vocab_size + 1), dtype=torch.bool,
                                  device=device)
        # The state holding each slot (a reference, so no other state can be taken for it).
        self._owner: list[CachedRequestState | None] = [None] * max_rows
        self._counted = [0] * max_rows  # output tokens each slot has counted
        self._slot_of: dict[str, int] = {}

    def slots(
        self,
        states: Sequence[CachedRequestState],
        history: History,
        to_device: Callable[[np.ndarray], torch.Tensor],
    ) -> np.ndarray:
        """The slot of each state for this step (int64; the spare for an unpenalized state),
        rebuilding the slots whose counts do not hold exactly the state's output tokens.
        Side effects: device operations (rebuilds); slots of requests not in `states` are
        reused when no slot is free."""
        out = np.full(len(states), self.spare, dtype=np.int64)
        stale: list[int] = []
        for row, state in enumerate(states):
            if not state.sampling_params.has_penalties:
                continue
            slot = self._slot_of.get(state.req_id)
            if slot is None or self._owner[slot] is not state:
                slot = self._take({id(s) for s in states})
                self._owner[slot], self._slot_of[state.req_id] = state, slot
                self._counted[slot] = -1
            out[row] = slot
            if self._counted[slot] != state.num_output_tokens:
                stale.append(row)
        if stale:
            self._rebuild([states[r] for r in stale], out[stale], history, to_device)
        return out

    def _take(self, in_step: set[int]) -> int:
        """A slot that no request of this step holds (there are as many slots as rows)."""
        for slot, owner in enumerate(self._owner):
            if owner is None or id(owner) not in in_step:
                if owner is not None and self._slot_of.get(owner.req_id) == slot:
                    del self._slot_of[owner.req_id]
                return slot
        raise RuntimeError("every penalty slot is held by this step's requests")

    def _rebuild(
        self,
        states: list[CachedRequestState],
        slots: np.ndarray,
        history: History,
        to_device: Callable[[np.ndarray], torch.Tensor],
    ) -> None:
        prompt_ids, output_ids, pending = history(states)
        device = self.counts.device
        rows = to_device(slots)[:, None]
        self.counts[rows[:, 0]] = 0.0
        self.prompt[rows[:, 0]] = False
        self.prompt[rows, prompt_ids] = True
        ids = pad_token_lists(output_ids, self.vocab_size, device)
        if pending is not None:
            ids = torch.cat([ids, pending], dim=1)
        self.counts.index_put_((rows.expand_as(ids), ids),
                               torch.ones(ids.shape, dtype=torch.float32, device=device),
                               accumulate=True)
        for state, slot in zip(states, slots.tolist()):
            self._counted[slot] = state.num_output_tokens

    def advance(self, slots: np.ndarray) -> None:
        """Records that the step which used `slots` counted one more token per penalized
        state (record() ran inside it)."""
        for slot in slots.tolist():
            if slot != self.spare:
                self._counted[slot] += 1

    def apply(self, x: torch.Tensor, slots: torch.Tensor, repetition: torch.Tensor,
              frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
        """x [n, V] float32 with each row's penalties applied, as ops/penalties.py applies
        them (a new tensor): repetition over prompt and output tokens, frequency and
        presence over output tokens. `slots` [n] (device), the penalties [n] float32.
        Fixed shapes, no host read."""
        vocab = x.shape[1]
        counts = self.counts.index_select(0, slots)[:, :vocab]
        seen = self.prompt.index_select(0, slots)[:, :vocab] | (counts > 0)
        r = repetition[:, None]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        # The same two subtractions, in the same order, as the eager path's.
        cut = x - frequency[:, None] * counts - presence[:, None]
        return torch.where(counts > 0, cut, x)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Adds each row's sampled token to its slot's counts. Fixed shapes, no host read.
        (The spare's counts grow too and mean nothing: the rows that read them have no
        penalty, 1 / 0 / 0, which leaves every logit as it was.)"""
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.float32),
                               accumulate=True)
