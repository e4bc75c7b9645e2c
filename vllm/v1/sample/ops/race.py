"""The exponential race with token-indexed noise.

Sampling token j with probability p_j is argmax_j p_j / q_j with q_j ~ Exp(1) i.i.d., i.e.
argmax_j z_j + g_j with g_j = -log q_j Gumbel. Two facts keep it cheap and reproducible:

* Noise is a hash of (row key, counter) (counter = token id, or V + block for block noise),
  so a row's draw depends only on its key and its own values: a seeded row's key is a mix of
  (seed, output position), which makes its token independent of batch composition, order
  and size. Only the noise actually looked at is computed.
* Drawing 151,936 random numbers per row is the dominant cost on a CPU (torch's
  `exponential_` takes about 0.75 s for [256, 151936]), so rows without top-k/top-p race in
  two levels: blocks of B tokens race with their masses S_b = sum of exp(z) in the block,
  then the tokens of the winning block race. P(j) = S_b / S * exp(z_j) / S_b = exp(z_j) / S:
  the same distribution as one race over the vocabulary, with V / B + B noise values.
Rows with top-k/top-p race only over their candidates (the kept set lies inside them).
"""

from __future__ import annotations

import hashlib

import torch

NEG_INF = float("-inf")
_M32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 tensor
# math never overflows on any device.
_C1 = 0x7FEB352D
_C2 = 0x2C1B3C6D


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix of an int64 tensor holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def gumbel(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [n, m] float32, a pure function of (keys[i], counters[i, j]).

    `keys` [n, 2] int64 in [0, 2**32); `counters` [n, m] or [m] int64, non-negative.
    Resolution is 24 bits (like torch's float32 uniform), so |noise| stays below about 17."""
    k1 = keys[:, 0:1]
    k2 = keys[:, 1:2]
    h = _mix(_mix((counters ^ k1) & _M32) ^ k2)
    # (top 24 bits + 0.5) / 2**24 is exact in float32 and lies strictly inside (0, 1).
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


def seeded_key(seed: int, position: int) -> tuple[int, int]:
    """Two 32-bit words mixing a user seed and an output position (deterministic everywhere)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    v = int.from_bytes(digest, "little")
    return v & _M32, v >> 32


def race_candidates(
    values: torch.Tensor, token_ids: torch.Tensor, threshold: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """Races the candidates of each row that are >= threshold; returns token ids [n] int64.

    The result depends on the kept set and its values only, not on how many candidates
    there are or their order (the noise is indexed by token id)."""
    score = values + gumbel(keys, token_ids)
    score.masked_fill_(values < threshold[:, None], NEG_INF)
    win = score.argmax(dim=1, keepdim=True)
    return token_ids.gather(1, win).squeeze(1)


def race_blocks(
    z: torch.Tensor, threshold: torch.Tensor | None, keys: torch.Tensor, block: int
) -> torch.Tensor:
    """Races all tokens of each row of z [n, V] with z >= threshold (None = no threshold) in
    two levels (blocks of `block` tokens, then tokens); returns token ids [n] int64.

    z must have a maximum of 0 per row (exp(z) must not overflow)."""
    n, vocab = z.shape
    dev = z.device
    e = torch.exp(z)
    if threshold is not None:
        e.masked_fill_(z < threshold[:, None], 0.0)
    full = vocab // block
    sums = [e[:, : full * block].reshape(n, full, block).sum(dim=2)] if full else []
    if vocab > full * block:
        sums.append(e[:, full * block :].sum(dim=1, keepdim=True))
    mass = torch.cat(sums, dim=1) if len(sums) > 1 else sums[0]
    num_blocks = mass.shape[1]
    block_noise = gumbel(keys, vocab + torch.arange(num_blocks, device=dev))
    best = (mass.log() + block_noise).argmax(dim=1, keepdim=True)
    cols = best * block + torch.arange(block, device=dev)
    valid = cols < vocab
    cols = cols.clamp(max=vocab - 1)
    zz = z.gather(1, cols)
    score = zz + gumbel(keys, cols)
    drop = ~valid if threshold is None else ~valid | (zz < threshold[:, None])
    score.masked_fill_(drop, NEG_INF)
    win = score.argmax(dim=1, keepdim=True)
    return cols.gather(1, win).squeeze(1)
