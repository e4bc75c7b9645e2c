"""Builds attention metadata and paged-cache layouts for tests."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from vllm.attention.backends.abstract import AttentionMetadata


@dataclass
class ReqStep:
    """One request's share of a step: tokens already cached, new tokens, and its blocks."""

    num_cached: int
    num_new: int
    block_ids: list[int]


def allocate_blocks(
    num_tokens_per_req: list[int], block_size: int, rng: random.Random, spare: int = 3
) -> tuple[list[list[int]], int]:
    """Gives each request enough blocks for its tokens, drawn from a shuffled pool.

    Returns (block ids per request, total number of blocks in the cache).
    """
    needed = [-(-n // block_size) for n in num_tokens_per_req]
    total = sum(needed) + spare
    pool = list(range(total))
    rng.shuffle(pool)
    out = []
    for n in needed:
        out.append(pool[:n])
        pool = pool[n:]
    return out, total


def make_metadata(
    steps: list[ReqStep], block_size: int, device: torch.device | str = "cpu", pad: int = 0
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Returns (metadata, positions [T + pad] int64) for one flat step over these requests.

    ``pad`` extra tokens are appended with slot -1 and position 0.
    """
    slots: list[int] = []
    positions: list[int] = []
    starts = [0]
    seq_lens = []
    for s in steps:
        for p in range(s.num_cached, s.num_cached + s.num_new):
            slots.append(s.block_ids[p // block_size] * block_size + p % block_size)
            positions.append(p)
        starts.append(starts[-1] + s.num_new)
        seq_lens.append(s.num_cached + s.num_new)
    width = max(len(s.block_ids) for s in steps)
    # Unused block-table entries hold an invalid id on purpose: backends must not read them.
    table = [s.block_ids + [-1] * (width - len(s.block_ids)) for s in steps]
    slots += [-1] * pad
    positions += [0] * pad
    qsl = torch.tensor(starts, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=starts[-1],
        num_reqs=len(steps),
        max_query_len=max(s.num_new for s in steps),
        max_seq_len=max(seq_lens),
        query_start_loc=qsl.to(device),
        seq_lens=lens.to(device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)
