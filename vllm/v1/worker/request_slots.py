"""Per-request device state that lets the post-layer function apply token edits and
penalties inside a graph.

A request's edits (allowed_token_ids, bad words of one token, the min_tokens ban of its stop
tokens, logit_bias, presence / frequency / repetition penalties) never change, and penalties
also read which tokens it has seen, the newest of them still on the device under async
scheduling. Sent each step, lists of them would change shape with every request and token.
Instead a request with any edit owns a slot (a row) of device tables, written once when it
takes the slot (token_rules.py gives their packed form):
  masks    [2 (slots + 1), words] int32: row 2 s packs the tokens slot s may sample, row
           2 s + 1 the same while min_tokens bans its stop tokens;
  bias     token ids [slots + 1, MAX_LOGIT_BIAS] int64 and values float32;
  penalty  [slots + 1, 3] float32: repetition, frequency and presence penalties;
and, when penalties are served, counts [slots + 1, V + 1] float32 of its output tokens and
prompt [slots + 1, V + 1] bool of its prompt's tokens (the last column absorbs padding ids).
The post-layer function adds each sampled token to its count, so decode steps keep the
counts current inside the graph. The host tracks how many tokens each slot has counted and
rebuilds the counts of a slot that lags (a new request, a step sampled eagerly, drafts kept,
a resumed request) before the step, outside the graph, by operations that never wait.

Each step the host sends one number per row, its table row: 2 s, or 2 s + 1 while min_tokens
holds. A request without edits reads the spare slot (the last): every token allowed, no bias,
no penalty, which leaves every logit as it was.

Memory (table_bytes): 2 (slots + 1) words x 4 + (slots + 1) x MAX_LOGIT_BIAS x 12 bytes,
and with penalties (slots + 1) x (V + 1) x 5 bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.sampling_params import MAX_LOGIT_BIAS
from vllm.v1.sample.ops.dense_sampling import apply_dense_bitmask
from vllm.v1.sample.ops.penalties import pad_token_array
from vllm.v1.worker.gpu_input_batch import CachedRequestState
from vllm.v1.worker.token_rules import (
    allowed_rows,
    bias_row,
    one_token_bad_words,
    stop_bans,
)

# (prompt ids [n, Lp] padded with the vocabulary size on the device, output ids on the
# host, output ids still on the device [n, P] or None): what SamplingInputs.penalty_history
# returns for a list of requests.
History = Callable[
    [list[CachedRequestState]], tuple[torch.Tensor, list[list[int]], torch.Tensor | None]
]


@dataclass(slots=True)
class _Entry:
    """What the host knows of a request's slot."""

    state: CachedRequestState
    slot: int  # the spare for a request without edits
    min_tokens: int  # 0 when min_tokens bans no token
    penalized: bool


@dataclass
class StepSlots:
    """A step's rows in the tables."""

    table_rows: np.ndarray  # [n] int64: 2 slot (+ 1 while min_tokens holds)
    edited: bool  # some row has a slot (a mask, a bias or penalties)
    counting: list[int] = field(default_factory=list)  # the penalized rows' slots


def table_bytes(max_rows: int, vocab_size: int, penalties: bool) -> int:
    """Device bytes of RequestSlots(max_rows, vocab_size, ...), with or without penalties."""
    n = max_rows + 1
    size = 2 * n * ((vocab_size + 31) // 32) * 4 + n * MAX_LOGIT_BIAS * 12 + n * 12
    return size + (n * (vocab_size + 1) * 5 if penalties else 0)


class RequestSlots:
    """The per-request tables (see module docstring) for `max_rows` requests at a time."""

    def __init__(
        self,
        max_rows: int,
        vocab_size: int,
        device: torch.device,
        to_device: Callable[[np.ndarray], torch.Tensor],
        history: History | None,
    ) -> None:
        """`history` gives the requests' tokens (SamplingInputs.penalty_history); None
        serves no penalties (rows() then sends a penalized step to the eager path)."""
        self.vocab_size = vocab_size
        self.spare = max_rows
        self.words = (vocab_size + 31) // 32
        self.to_device = to_device
        self.history = history
        n = max_rows + 1
        self.masks = torch.full((2 * n, self.words), -1, dtype=torch.int32, device=device)
        self.bias_ids = torch.zeros((n, MAX_LOGIT_BIAS), dtype=torch.int64, device=device)
        self.bias_values = torch.zeros((n, MAX_LOGIT_BIAS), dtype=torch.float32, device=device)
        self.penalty = torch.tensor([[1.0, 0.0, 0.0]], device=device).repeat(n, 1)
        self.counts = self.prompt = None
        if history is not None:
            self.counts = torch.zeros((n, vocab_size + 1), dtype=torch.float32, device=device)
            self.prompt = torch.zeros((n, vocab_size + 1), dtype=torch.bool, device=device)
        self._arange = torch.arange(n, device=device)
        self._owner: list[_Entry | None] = [None] * max_rows
        self._counted = [0] * max_rows  # output tokens each slot's counts hold
        self._entries: dict[str, _Entry] = {}

    # ------------------------------------------------------------------ host

    def rows(self, states: Sequence[CachedRequestState]) -> StepSlots | None:
        """Each state's table row for this step, giving a slot to each new request with
        edits and rebuilding the counts that lag; None when a request needs penalties and
        none are served. Side effects: device operations (a slot's tables, rebuilds);
        slots of requests not in `states` are reused when no slot is free."""
        index = np.empty(len(states), dtype=np.int64)
        step = StepSlots(index, False)
        stale: list[int] = []
        in_step: set[int] | None = None
        for row, state in enumerate(states):
            entry = self._entries.get(state.req_id)
            if entry is None or entry.state is not state:
                if in_step is None:
                    in_step = {id(s) for s in states}
                entry = self._admit(state, in_step)
            slot = entry.slot
            index[row] = 2 * slot + (state.num_output_tokens < entry.min_tokens)
            step.edited |= slot != self.spare
            if entry.penalized:
                step.counting.append(slot)
                if self._counted[slot] != state.num_output_tokens:
                    stale.append(row)
        if step.counting and self.counts is None:
            return None
        if stale:
            self._rebuild([states[r] for r in stale], index[stale] // 2)
        return step

    def advance(self, step: StepSlots) -> None:
        """Records that `step` ran record(): its penalized slots counted one more token."""
        for slot in step.counting:
            self._counted[slot] += 1

    def _admit(self, state: CachedRequestState, in_step: set[int]) -> _Entry:
        p = state.sampling_params
        stops = stop_bans(p, self.vocab_size)
        edited = bool(p.allowed_token_ids or p.logit_bias or stops
                      or one_token_bad_words(p, self.vocab_size))
        entry = _Entry(state, self.spare, p.min_tokens if stops else 0, p.has_penalties)
        if edited or entry.penalized:
            entry.slot = slot = self._take(in_step)
            self._owner[slot] = entry
            self._counted[slot] = -1
            self.masks[2 * slot : 2 * slot + 2] = self.to_device(
                allowed_rows(p, self.vocab_size, self.words))
            ids, values = bias_row(p, MAX_LOGIT_BIAS)
            self.bias_ids[slot] = self.to_device(ids)
            self.bias_values[slot] = self.to_device(values)
            self.penalty[slot] = self.to_device(np.asarray(
                [p.repetition_penalty, p.frequency_penalty, p.presence_penalty],
                dtype=np.float32))
        if len(self._entries) > 4 * self.spare:  # forget requests that are long gone
            held = {id(e.state) for e in self._owner if e is not None} | in_step
            self._entries = {r: e for r, e in self._entries.items() if id(e.state) in held}
        self._entries[state.req_id] = entry
        return entry

    def _take(self, in_step: set[int]) -> int:
        """A slot that no request of this step holds (there are as many slots as rows)."""
        for slot, owner in enumerate(self._owner):
            if owner is None or id(owner.state) not in in_step:
                if owner is not None and self._entries.get(owner.state.req_id) is owner:
                    del self._entries[owner.state.req_id]
                return slot
        raise RuntimeError("every request slot is held by this step's requests")

    def _rebuild(self, states: list[CachedRequestState], slots: np.ndarray) -> None:
        prompt_ids, output_ids, pending = self.history(states)
        device = self.counts.device
        rows = self.to_device(slots)
        self.counts[rows] = 0.0
        self.prompt[rows] = False
        self.prompt[rows[:, None], prompt_ids] = True
        # Pinned: a long output's copy never stalls the host.
        ids = self.to_device(pad_token_array(output_ids, self.vocab_size))
        if pending is not None:
            ids = torch.cat([ids, pending], dim=1)
        self.counts.index_put_((rows[:, None].expand_as(ids), ids),
                               torch.ones(ids.shape, dtype=torch.float32, device=device),
                               accumulate=True)
        for state, slot in zip(states, slots.tolist()):
            self._counted[slot] = state.num_output_tokens

    # ---------------------------------------------------------------- device

    @staticmethod
    def slots_of(table_rows: torch.Tensor) -> torch.Tensor:
        """The slot of each table row (its half), on the device."""
        return torch.div(table_rows, 2, rounding_mode="floor")

    def edit(self, logits: torch.Tensor, table_rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Applies each row's mask (row `table_rows` of masks) and bias (of its slot) to
        `logits` [n, V] float32 in place. Fixed shapes, no host read."""
        apply_dense_bitmask(logits, self.masks.index_select(0, table_rows))
        ids = self.bias_ids.index_select(0, slots)
        rows = self._arange[: ids.shape[0], None].expand_as(ids)
        # Padding entries add 0 to token 0: no logit changes, in any order.
        logits.index_put_((rows, ids), self.bias_values.index_select(0, slots), accumulate=True)

    def penalize(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """x [n, V] float32 with the penalties of each row's slot applied, as
        ops/penalties.py applies them (a new tensor): repetition over prompt and output
        tokens, frequency and presence over output tokens. Fixed shapes, no host read."""
        vocab = x.shape[1]
        counts = self.counts.index_select(0, slots)[:, :vocab]
        seen = self.prompt.index_select(0, slots)[:, :vocab] | (counts > 0)
        penalty = self.penalty.index_select(0, slots)
        r = penalty[:, 0:1]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        # The same two subtractions, in the same order, as the eager path's.
        cut = x - penalty[:, 1:2] * counts - penalty[:, 2:3]
        return torch.where(counts > 0, cut, x)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Adds each row's sampled token to its slot's counts. Fixed shapes, no host read.
        (The spare's counts grow too and mean nothing: the rows that read them have no
        penalty, 1 / 0 / 0, which leaves every logit as it was.)"""
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.float32),
                               accumulate=True)
