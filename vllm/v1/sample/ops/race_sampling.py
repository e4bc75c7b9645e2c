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
# Bits of the hash that make a uniform: 23 keeps every (cell + 0.5) exact in float32.
UNIFORM_BITS = 23


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix of an int64 tensor holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def noise_hash(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash [n, m] int64 of (keys[i], counters[i, j]) that the noise is made from.

    `keys` [n, 2] int64 in [0, 2**32); `counters` [n, m] or [m] int64, non-negative."""
    k1 = keys[:, 0:1]
    k2 = keys[:, 1:2]
    return _mix(_mix((counters ^ k1) & _M32) ^ k2)


def uniform_from_hash(h: torch.Tensor) -> torch.Tensor:
    """Maps 32-bit hashes (int64 tensor) to float32 uniforms strictly inside (0, 1).

    Uses the top UNIFORM_BITS bits only: u = (top + 0.5) / 2**UNIFORM_BITS, the midpoints of
    2**23 equal cells, each hit by 2**9 hashes."""
    # top + 0.5 needs UNIFORM_BITS + 1 = 24 significant bits, exactly float32's precision,
    # so the sum and the power-of-two scaling are exact and the largest u is 1 - 2**-24.
    # With 24 bits the top value 2**24 - 0.5 would round up to 2**24, giving u == 1.0 and
    # +inf noise (a masked token would then score -inf + inf = nan and win the argmax).
    top = (h >> (32 - UNIFORM_BITS)).to(torch.float32)
    return (top + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def gumbel_from_uniform(u: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise -log(-log(u)) of uniforms u in (0, 1) (finite there)."""
    return -torch.log(-torch.log(u))


def gumbel(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [n, m] float32, a pure function of (keys[i], counters[i, j]).

    `keys` [n, 2] int64 in [0, 2**32); `counters` [n, m] or [m] int64, non-negative.
    Underneath, u has 23 bits of resolution and lies strictly inside (0, 1), so the noise is
    always finite: between about -2.82 and 16.64."""
    return gumbel_from_uniform(uniform_from_hash(noise_hash(keys, counters)))


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
