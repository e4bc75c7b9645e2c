"""The token sampler: greedy, temperature, top-k, top-p, min-p, seeds, penalties, logprobs.

Order per row: grammar mask -> allowed_token_ids -> bad words -> logit_bias -> min_tokens ban ->
penalties -> greedy rows take the argmax -> random rows: temperature -> top-k -> top-p ->
min-p -> exponential race (see ops/race_sampling.py).

Greedy argmax on CPU float32 logits is the native one-pass kernel (`_custom_ops.masked_argmax`,
the same answer as torch.argmax, several times faster). A batch that is all greedy, without
logprobs or token edits, is sampled by that kernel alone with the grammar mask read in the
same pass: the logits are read once and never written. Otherwise the grammar mask is first
written into the logits (-inf) and the rows go through the steps above.

Rows are processed in chunks: on a CPU a few rows at a time so the vocabulary-sized
temporaries stay in cache (large fresh tensors cost page faults and memory bandwidth), on
other devices the whole batch at once. Every row's result depends on that row alone.

Off the CPU the sampler runs its fixed-shape path (`fixed_shape`, ops/dense_sampling.py):
every row goes through the same operations, top-k / top-p take a full sort of every row of a
batch that uses them, and nothing reads a device value on the host, so a step never waits for
the device here (the default path would, to size torch.topk by the largest k and to find the
rows its candidates cannot decide). On a CPU those reads cost nothing and the candidates are
much cheaper than a full sort, so the CPU keeps the default path; both give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from vllm import _custom_ops as ops
from vllm.v1.sample.metadata import GREEDY_TEMPERATURE, GrammarMask, SamplingMetadata
from vllm.v1.sample.ops.dense_sampling import (
    DenseRows,
    choose_plan,
    host_noise_keys,
    sample_dense,
)
from vllm.v1.sample.ops.penalties import apply_penalties, ban_tokens, pad_token_lists
from vllm.v1.sample.ops.race_sampling import race_blocks, race_candidates, seeded_key
from vllm.v1.sample.ops.token_edits import add_bias, ban_completions, keep_only
from vllm.v1.sample.ops.topk_topp import (
    candidates,
    min_p_threshold,
    sorted_candidates,
)

# Candidates taken by torch.topk for top-p rows; rows whose nucleus is larger get a full sort.
TOP_P_CANDIDATES = 1024
# Tokens per block in the two-level race (about sqrt of a 150k vocabulary).
RACE_BLOCK = 512
# CPU chunk size in logits elements (about 4 MiB of float32).
CPU_CHUNK_ELEMENTS = 1 << 20


@dataclass
class LogprobsTensors:
    """Logprobs of one step: column 0 is the sampled token, columns 1..k the top-k."""

    token_ids: torch.Tensor  # [N, k + 1] int64
    logprobs: torch.Tensor  # [N, k + 1] float32
    ranks: torch.Tensor  # [N] int64: 1 + number of tokens with a strictly higher logprob


@dataclass
class SamplerOutput:
    """Sampled token per row, and the logprobs when the metadata asked for them."""

    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None


@dataclass
class _Rows:
    """The per-row parameters of one chunk of rows."""

    inv_temperature: torch.Tensor | None  # [n]; 1 on greedy rows; None when all greedy
    greedy: torch.Tensor | None  # [n] bool; None when no row is greedy
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    keys: torch.Tensor | None  # [n, 2] int64 noise keys


class Sampler(nn.Module):
    """Samples one token per row of a [N, V] float32 logits tensor (CPU or CUDA)."""

    def __init__(
        self,
        top_p_candidates: int = TOP_P_CANDIDATES,
        race_block: int = RACE_BLOCK,
        chunk_rows: int | None = None,
        fixed_shape: bool | None = None,
    ) -> None:
        """`chunk_rows` overrides the rows per chunk (default: ~4 MiB on CPU, all otherwise).
        `fixed_shape` picks the path (module docstring): None = fixed-shape off the CPU only."""
        super().__init__()
        if top_p_candidates < 1:
            raise ValueError(f"top_p_candidates: must be positive, got {top_p_candidates}")
        if race_block < 1:
            raise ValueError(f"race_block: must be positive, got {race_block}")
        if chunk_rows is not None and chunk_rows < 1:
            raise ValueError(f"chunk_rows: must be positive, got {chunk_rows}")
        self.top_p_candidates = top_p_candidates
        self.race_block = race_block
        self.chunk_rows = chunk_rows
        self.fixed_shape = fixed_shape

    def is_fixed_shape(self, device: torch.device) -> bool:
        """Whether logits on `device` take the fixed-shape path."""
        return device.type != "cpu" if self.fixed_shape is None else self.fixed_shape

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Samples a token per row. `logits` is not modified, except that the grammar mask of
        `metadata.grammar_mask` is written into its constrained rows (-inf) when the batch
        is not sampled by the fused greedy pass.

        Raises ValueError on a logits tensor that is not [N, V] floating point, on metadata
        that does not match it, or on a grammar mask with logits that are not contiguous
        float32 on the CPU."""
        if logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(
                "logits: expected a [N, V] floating tensor, "
                f"got {tuple(logits.shape)} {logits.dtype}"
            )
        n, vocab = logits.shape
        metadata.validate(n, vocab)
        dev = logits.device
        k = metadata.max_num_logprobs
        bans = _bans(metadata, vocab)
        grammar = metadata.grammar_mask
        if grammar is not None and not _native_rows(logits, contiguous=True):
            raise ValueError(
                "grammar_mask: needs contiguous float32 CPU logits, got "
                f"{logits.dtype} on {dev} (apply the mask to the logits instead)"
            )
        fixed = self.is_fixed_shape(dev)
        if metadata.all_greedy and k is None and not bans and not _edits(metadata) and not fixed:
            # Nothing but the argmax reads the logits: one pass, the mask read on the way.
            return SamplerOutput(_argmax(logits, grammar), None)
        if grammar is not None:
            _apply_grammar(logits, grammar)
        keys = None if metadata.all_greedy else _noise_keys(metadata, n, dev)
        tokens = torch.empty(n, dtype=torch.int64, device=dev)
        lp = None
        if k is not None:
            lp = LogprobsTensors(
                torch.empty((n, k + 1), dtype=torch.int64, device=dev),
                torch.empty((n, k + 1), dtype=torch.float32, device=dev),
                torch.empty(n, dtype=torch.int64, device=dev),
            )
        step = self._chunk_rows(n, vocab, dev)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            raw = logits[lo:hi].float()
            x = self._edit(raw, metadata, bans, lo, hi)
            if fixed:
                plan = choose_plan(metadata.all_greedy,
                                   metadata.top_k is not None or metadata.top_p is not None)
                tokens[lo:hi] = sample_dense(x, _dense_rows(metadata, keys, lo, hi, dev), plan,
                                             self.race_block)
            else:
                tokens[lo:hi] = self._sample(x, _rows(metadata, keys, lo, hi))
            if lp is not None:
                _logprobs(raw, tokens[lo:hi], k, lp, lo, hi)
        return SamplerOutput(tokens, lp)

    def _chunk_rows(self, n: int, vocab: int, dev: torch.device) -> int:
        if self.chunk_rows is not None:
            return self.chunk_rows
        if dev.type != "cpu":
            return max(n, 1)
        return max(1, CPU_CHUNK_ELEMENTS // max(vocab, 1))

    def _edit(
        self,
        raw: torch.Tensor,
        md: SamplingMetadata,
        bans: dict[int, list[int]],
        lo: int,
        hi: int,
    ) -> torch.Tensor:
        """The chunk's logits after the token edits, the min_tokens ban and penalties (a copy
        if edited)."""
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for row in range(lo, hi) if bans else ():
            ids = bans.get(row)
            if ids:
                ban_rows += [row - lo] * len(ids)
                ban_ids += ids
        allowed = _chunk(md.allowed_token_ids, lo, hi)
        bias = _chunk(md.logit_bias, lo, hi)
        words = _chunk(md.bad_words, lo, hi)
        for row, seqs in words.items():
            single = [q[0] for q in seqs if len(q) == 1]
            ban_rows += [row] * len(single)
            ban_ids += single
        penalize = _penalize(md)
        if not ban_rows and not penalize and not allowed and not bias and not words:
            return raw
        x = raw.clone()
        keep_only(x, allowed)
        if words and md.recent_output_token_ids is not None:
            ban_completions(x, words, md.recent_output_token_ids[lo:hi])
        add_bias(x, bias)
        ban_tokens(x, ban_rows, ban_ids)
        if not penalize:
            return x
        vocab = x.shape[1]
        out_ids = pad_token_lists(md.output_token_ids[lo:hi], vocab, x.device)
        if md.pending_output_token_ids is not None:
            out_ids = torch.cat([out_ids, md.pending_output_token_ids[lo:hi]], dim=1)
        prompt = md.prompt_token_ids[lo:hi] if md.prompt_token_ids is not None else None
        return apply_penalties(
            x,
            prompt,
            out_ids,
            _slice(md.repetition_penalties, lo, hi),
            _slice(md.frequency_penalties, lo, hi),
            _slice(md.presence_penalties, lo, hi),
        )

    def _sample(self, x: torch.Tensor, rows: _Rows) -> torch.Tensor:
        """Token per row of the edited chunk logits x [n, V]."""
        if rows.inv_temperature is None:
            return _argmax(x)
        if rows.greedy is None:
            return self._random(x, rows)
        greedy = _argmax(x)
        if not _maybe_any(~rows.greedy):
            return greedy
        return torch.where(rows.greedy, greedy, self._random(x, rows))

    def _random(self, x: torch.Tensor, rows: _Rows) -> torch.Tensor:
        """Temperature, filters and the race for every row of x (greedy rows too: cheaper
        than compacting, and their result is discarded)."""
        n, vocab = x.shape
        top = x.amax(dim=1, keepdim=True)
        # Rows that are all -inf would give nan; their (meaningless) token comes out finite.
        top = torch.where(top > float("-inf"), top, torch.zeros_like(top))
        # z = (x - max) / T: max is exactly 0, so exp(z) cannot overflow and min-p is log(min_p).
        z = (x - top).mul_(rows.inv_temperature[:, None])
        min_t = None if rows.min_p is None else min_p_threshold(rows.min_p)
        if min_t is not None and not _maybe_any(min_t > float("-inf")):
            min_t = None
        filtered = _filtered_rows(rows, vocab)
        out = None
        if filtered is None or _maybe_any(~filtered):
            out = race_blocks(z, min_t, rows.keys, self.race_block)
        if filtered is not None and _maybe_any(filtered):
            picked = self._race_filtered(z, rows, min_t)
            out = picked if out is None else torch.where(filtered, picked, out)
        return out

    def _race_filtered(
        self, z: torch.Tensor, rows: _Rows, min_t: torch.Tensor | None
    ) -> torch.Tensor:
        """Race of the rows with top-k/top-p over their candidates (other rows: ignored)."""
        n, vocab = z.shape
        top_k = rows.top_k
        top_p = rows.top_p
        if top_p is not None and not _maybe_any(top_p < 1.0):
            top_p = None
        num = 0
        if top_k is not None:
            active = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.zeros_like(top_k))
            # Sync on non-CPU devices: torch.topk needs a Python int. One more than the largest
            # k lets `complete` see whether the k-th value ties with the next one.
            num = int(active.max()) + 1
        if top_p is not None:
            num = max(num, self.top_p_candidates)
        full_lse = None
        if top_p is not None and (top_k is None or _maybe_any((top_k <= 0) | (top_k >= vocab))):
            # z <= 0 with a 0 in every row: the plain sum cannot overflow or vanish.
            full_lse = torch.exp(z).sum(dim=1).log()
        cand = candidates(z, top_k, top_p, full_lse, num)
        picked = race_candidates(
            cand.values, cand.token_ids, _max(cand.threshold, min_t), rows.keys
        )
        filtered = _filtered_rows(rows, vocab)
        # Sync on non-CPU devices: which rows need the exact full-sort fallback.
        redo = (filtered & ~cand.complete).nonzero().squeeze(1)
        if redo.numel() == 0:
            return picked
        full = sorted_candidates(
            z[redo],
            _take(top_k, redo),
            _take(top_p, redo),
            None if full_lse is None else full_lse[redo],
        )
        again = race_candidates(
            full.values, full.token_ids, _max(full.threshold, _take(min_t, redo)), rows.keys[redo]
        )
        return picked.index_copy(0, redo, again)


def _bans(md: SamplingMetadata, vocab: int) -> dict[int, list[int]]:
    """Row -> token ids banned this step by min_tokens. Ids outside the vocabulary can never
    be sampled, so they need no ban (and must not fail a whole batch)."""
    bans = {}
    for row, (min_tokens, stop_ids) in md.min_tokens.items():
        ids = sorted(t for t in stop_ids if 0 <= t < vocab)
        if md.output_positions[row] < min_tokens and ids:
            bans[row] = ids
    return bans


def _penalize(md: SamplingMetadata) -> bool:
    """Whether any row of the batch has a penalty."""
    return not md.no_penalties and any(
        t is not None
        for t in (md.presence_penalties, md.frequency_penalties, md.repetition_penalties)
    )


def _edits(md: SamplingMetadata) -> bool:
    """Whether any row's logits are edited before sampling (besides the min_tokens ban)."""
    return bool(md.allowed_token_ids or md.logit_bias or md.bad_words) or _penalize(md)


def _native_rows(x: torch.Tensor, contiguous: bool = False) -> bool:
    """Whether the native CPU kernels can read x [n, V] in place as float32 rows."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad:
        return False
    if contiguous:
        return x.is_contiguous()
    n, vocab = x.shape
    return n > 0 and vocab > 0 and x.stride(1) == 1 and (n == 1 or x.stride(0) >= vocab)


def _argmax(x: torch.Tensor, grammar: GrammarMask | None = None) -> torch.Tensor:
    """x.argmax(dim=1) (first largest, NaN first), with the grammar's disallowed tokens
    counted as -inf; the native one-pass kernel where it can read x."""
    if not _native_rows(x):
        return x.argmax(dim=1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if grammar is None:
        ops.masked_argmax(x.numpy(), None, None, out.numpy())
    else:
        ops.masked_argmax(x.numpy(), grammar.bitmask, grammar.rows, out.numpy())
    return out


def _apply_grammar(logits: torch.Tensor, grammar: GrammarMask) -> None:
    """Writes -inf over the tokens each constrained row's mask forbids (side effect: edits
    `logits`, contiguous float32 on the CPU)."""
    rows = np.flatnonzero(grammar.rows >= 0).astype(np.int64)
    if rows.size:
        ops.apply_token_bitmask(logits.numpy(), grammar.bitmask, rows, grammar.rows[rows])


def _noise_keys(md: SamplingMetadata, n: int, dev: torch.device) -> torch.Tensor:
    """[n, 2] int64 keys: seeded rows mix (seed, position); the rest come from the generator
    in one batched draw (on the host for a CPU generator, then one copy to `dev`)."""
    gen = md.generator
    gen_dev = gen.device if gen is not None else torch.device("cpu")
    if gen_dev.type == "cpu":
        keys = host_noise_keys(md.seeds, md.output_positions, gen)
        return keys if dev.type == "cpu" else keys.to(dev, non_blocking=True)
    seeded = [i for i, s in enumerate(md.seeds) if s is not None]
    if len(seeded) < n:
        keys = torch.randint(
            0, 1 << 32, (n, 2), generator=gen, device=gen_dev, dtype=torch.int64
        ).to(dev)
    else:
        keys = torch.empty((n, 2), dtype=torch.int64, device=dev)
    if seeded:
        words = [seeded_key(md.seeds[i], md.output_positions[i]) for i in seeded]
        idx = torch.tensor(seeded, dtype=torch.int64).to(dev, non_blocking=True)
        keys.index_copy_(0, idx, torch.tensor(words, dtype=torch.int64).to(dev, non_blocking=True))
    return keys


def _rows(md: SamplingMetadata, keys: torch.Tensor | None, lo: int, hi: int) -> _Rows:
    inv = greedy = None
    if md.temperature is not None and not md.all_greedy:
        t = md.temperature[lo:hi].float()
        if not md.all_random:
            greedy = t < GREEDY_TEMPERATURE
        inv = torch.where(t < GREEDY_TEMPERATURE, torch.ones_like(t), 1.0 / t)
    return _Rows(
        inv,
        greedy,
        _slice(md.top_k, lo, hi),
        _slice(md.top_p, lo, hi),
        _slice(md.min_p, lo, hi),
        None if keys is None else keys[lo:hi],
    )


def _dense_rows(
    md: SamplingMetadata, keys: torch.Tensor | None, lo: int, hi: int, dev: torch.device
) -> DenseRows:
    """Rows [lo, hi) of the metadata with every parameter present ('off' where absent)."""
    n = hi - lo

    def column(t: torch.Tensor | None, off: float, dtype: torch.dtype) -> torch.Tensor:
        return t[lo:hi] if t is not None else torch.full((n,), off, dtype=dtype, device=dev)

    return DenseRows(
        column(md.temperature, 0.0, torch.float32),
        column(md.top_k, 0, torch.int64),
        column(md.top_p, 1.0, torch.float32),
        column(md.min_p, 0.0, torch.float32),
        keys[lo:hi] if keys is not None else torch.zeros((n, 2), dtype=torch.int64, device=dev),
    )


def _filtered_rows(rows: _Rows, vocab: int) -> torch.Tensor | None:
    """[n] bool: rows with an active top-k or top-p; None when the batch has neither."""
    mask = None
    if rows.top_k is not None:
        mask = (rows.top_k > 0) & (rows.top_k < vocab)
    if rows.top_p is not None:
        p = rows.top_p < 1.0
        mask = p if mask is None else mask | p
    return mask


def _logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, k: int, out: LogprobsTensors, lo: int, hi: int
) -> None:
    """Fills rows [lo, hi) of `out` from the unedited logits. Side effect: writes `out`."""
    lp = torch.log_softmax(raw, dim=1)
    chosen = lp.gather(1, tokens[:, None])
    out.token_ids[lo:hi, 0] = tokens
    out.logprobs[lo:hi, 0] = chosen.squeeze(1)
    out.ranks[lo:hi] = (lp > chosen).sum(dim=1) + 1
    if k > 0:
        vals, ids = torch.topk(lp, k, dim=1)
        out.token_ids[lo:hi, 1:] = ids
        out.logprobs[lo:hi, 1:] = vals


def _chunk(per_row: dict, lo: int, hi: int) -> dict:
    """The entries of a row-keyed dict for rows [lo, hi), keyed by row - lo."""
    if not per_row:
        return {}
    return {row - lo: v for row, v in per_row.items() if lo <= row < hi}


def _maybe_any(mask: torch.Tensor) -> bool:
    """mask.any() on a CPU; True elsewhere (a conservative answer that needs no sync)."""
    return bool(mask.any()) if mask.device.type == "cpu" else True


def _slice(t: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    return None if t is None else t[lo:hi]


def _take(t: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t[idx]


def _max(a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return a if b is None else torch.maximum(a, b)
