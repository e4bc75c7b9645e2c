"""Sampling with a fixed sequence of operations: what a CUDA graph can capture.

The Sampler's default path decides on the host which work a batch needs (no top-k: no
candidates; top-k: torch.topk sized by the largest k; rows the candidates cannot decide: a
full sort of those rows only). Off the CPU each of those decisions reads device values (a
synchronisation) and changes the shapes the kernels see. Here every row of a batch goes
through the same operations whatever its parameters: a row's values select results with
torch.where, never which kernels run or which shapes they see. So the work never waits for
the device, and one captured graph replays it for any mix of rows.

Three plans, chosen per batch on the host from the requests' parameters (never from device
values), each a fixed sequence of operations:
  GREEDY:   argmax.
  RANDOM:   + temperature, min-p and the two-level race of every row; greedy rows keep their
            argmax.
  FILTERED: + top-k / top-p thresholds from a full descending sort of every row, and the race
            over the kept tokens for the rows that filter.
A request that changes mode moves its batch to another plan (another graph), never to an
eager step.

Same tokens as the Sampler's default path for the same rows and noise keys: the noise is a
function of (key, token id), the kept set is a function of the row's values, and the full
sort is the exact fallback the default path itself takes for rows its candidates cannot
decide (ops/topk_topp.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from vllm.v1.sample.metadata import GREEDY_TEMPERATURE
from vllm.v1.sample.ops.race_sampling import race_blocks, race_candidates, seeded_key
from vllm.v1.sample.ops.topk_topp import min_p_threshold, sorted_candidates

NEG_INF = float("-inf")


class Plan(enum.Enum):
    """Which operations a batch runs (see the module docstring)."""

    GREEDY = "greedy"
    RANDOM = "random"
    FILTERED = "filtered"


def choose_plan(all_greedy: bool, any_filter: bool) -> Plan:
    """The cheapest plan that samples every row right: GREEDY when every row is greedy,
    FILTERED when some row has top-k or top-p, else RANDOM."""
    if all_greedy:
        return Plan.GREEDY
    return Plan.FILTERED if any_filter else Plan.RANDOM


@dataclass
class DenseRows:
    """Every row's sampling parameters, with the value that means 'off' where unused."""

    temperature: torch.Tensor  # [n] float32; below GREEDY_TEMPERATURE = greedy
    top_k: torch.Tensor  # [n] integer, 0 (or >= vocab) = off
    top_p: torch.Tensor  # [n] float32, 1.0 = off
    min_p: torch.Tensor  # [n] float32, 0.0 = off
    keys: torch.Tensor  # [n, 2] int64 noise keys (ops/race_sampling.py)

    def rows(self, lo: int, hi: int) -> DenseRows:
        """The parameters of rows [lo, hi) (views)."""
        return DenseRows(self.temperature[lo:hi], self.top_k[lo:hi], self.top_p[lo:hi],
                         self.min_p[lo:hi], self.keys[lo:hi])


def sample_dense(x: torch.Tensor, rows: DenseRows, plan: Plan, race_block: int) -> torch.Tensor:
    """One token per row of the (edited) float32 logits x [n, V] under `plan`; [n] int64.

    Reads no device value on the host and allocates no data-dependent shape; x is not
    modified."""
    greedy_tokens = x.argmax(dim=1)
    if plan is Plan.GREEDY:
        return greedy_tokens
    vocab = x.shape[1]
    t = rows.temperature.float()
    greedy = t < GREEDY_TEMPERATURE
    inv = torch.where(greedy, torch.ones_like(t), 1.0 / t)
    top = x.amax(dim=1, keepdim=True)
    # Rows that are all -inf would give nan; their (meaningless) token comes out finite.
    top = torch.where(top > NEG_INF, top, torch.zeros_like(top))
    # z = (x - max) / T: max is exactly 0, so exp(z) cannot overflow and min-p is log(min_p).
    z = (x - top).mul_(inv[:, None])
    # -inf where min-p is off: a threshold that keeps every token changes no value.
    min_t = min_p_threshold(rows.min_p)
    out = race_blocks(z, min_t, rows.keys, race_block)
    if plan is Plan.FILTERED:
        k = rows.top_k
        filtered = ((k > 0) & (k < vocab)) | (rows.top_p < 1.0)
        # z <= 0 with a 0 in every row: the plain sum cannot overflow or vanish.
        full_lse = torch.exp(z).sum(dim=1).log()
        cand = sorted_candidates(z, k, rows.top_p, full_lse)
        threshold = torch.maximum(cand.threshold, min_t)
        picked = race_candidates(cand.values, cand.token_ids, threshold, rows.keys)
        out = torch.where(filtered, picked, out)
    return torch.where(greedy, greedy_tokens, out)


def apply_dense_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets to -inf every logit whose bit is clear in its row of `bitmask` ([n, W] int32 on
    the logits' device, W * 32 >= V; bit j of word w allows token 32 * w + j). An
    unconstrained row is all ones (-1 words). Side effect: edits `logits` [n, V] in place.

    Every row is masked with the same operations, constrained or not (capturable)."""
    n, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    # Arithmetic shifts of negative words keep bit j at position 0 all the same.
    bits = (bitmask[:, :, None] >> shifts) & 1
    allowed = bits.reshape(n, -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, NEG_INF)


def host_noise_keys(
    seeds: list[int | None], positions: list[int], generator: torch.Generator | None
) -> torch.Tensor:
    """[n, 2] int64 noise keys on the host: seeded rows mix (seed, output position); the rest
    come from `generator` (a CPU generator, None = torch's default) in one draw of n rows,
    made whenever some row is unseeded (so the generator advances the same way whatever
    the seeded rows are)."""
    n = len(seeds)
    seeded = [i for i, s in enumerate(seeds) if s is not None]
    if len(seeded) < n:
        keys = torch.randint(0, 1 << 32, (n, 2), generator=generator, dtype=torch.int64)
    else:
        keys = torch.empty((n, 2), dtype=torch.int64)
    if seeded:
        words = np.asarray([seeded_key(seeds[i], positions[i]) for i in seeded],
                           dtype=np.int64)
        keys.numpy()[seeded] = words
    return keys
