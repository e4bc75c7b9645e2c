"""Draft-model drafting: a small model with the target's vocabulary guesses the next tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from vllm.model_executor.greedy_decode_loop import BareDecoder


class DraftModelProposer:
    """Drafts by greedy decoding with a small model (docs/architecture.md §11).

    It runs in the scheduler's process, on the target's device. Each drafting request owns
    a row of a contiguous KV cache that holds its confirmed tokens: a proposal first computes
    the tokens confirmed since the request's previous proposal (one forward for all requests
    with at most k + 1 of them, one per request for the others, e.g. first proposals), then
    decodes the drafts of all requests together. The drafts' keys and values are
    written past the confirmed tokens, where the next proposal overwrites them, so nothing
    is rolled back. A request keeps its row (through preemption too) until `release`; with
    every row taken, further requests simply get no drafts.
    """

    def __init__(self, model_dir: str | Path, num_tokens: int, max_num_seqs: int,
                 max_model_len: int, vocab_size: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        """Loads the draft model and allocates its cache. Raises ValueError when its
        vocabulary is not the target's size (token ids would mean different things), its
        architecture is unsupported, or its cache does not fit in the device's memory."""
        self.model = BareDecoder(model_dir, dtype=dtype, device=device)
        if self.model.vocab_size != vocab_size:
            raise ValueError(
                f"--speculative-config.model: the draft model's vocabulary has "
                f"{self.model.vocab_size} tokens, the target's {vocab_size}; they must share it"
            )
        self.num_tokens = num_tokens
        self.device = torch.device(device)
        try:
            self.cache = self.model.new_cache(max_num_seqs, max_model_len)
        except RuntimeError as e:  # torch.OutOfMemoryError on CUDA; a plain one on the CPU
            size = self.model.cache_bytes(max_num_seqs, max_model_len)
            raise ValueError(
                f"--speculative-config.model: the draft model's cache ({max_num_seqs} rows of "
                f"{max_model_len} tokens, {size / 2**30:.1f} GiB) does not fit in the "
                f"device's memory; lower --max-num-seqs or --max-model-len"
            ) from e
        self._slots = torch.arange(max_model_len, device=self.device)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._rows: dict[str, int] = {}
        self._num_cached: dict[str, int] = {}

    @torch.inference_mode()
    def propose_batch(
        self, contexts: dict[str, tuple[list[int], int, int]]
    ) -> dict[str, list[int]]:
        """Drafts to follow each request's tokens: `contexts[id]` is (tokens, how many of them
        are confirmed, most drafts). Tokens past the confirmed ones (drafts forced by a
        grammar) are computed but not kept as cached. Returns only non-empty drafts."""
        firsts: dict[str, torch.Tensor] = {}
        # Requests with up to `window` new tokens and that many before them catch up in one
        # forward over their last `window` tokens (recomputing a few cached ones); the rest
        # (first proposals) one by one. A proposal one step stale (async scheduling) sees
        # the previous step's kept tokens (up to k + 1), the drafts in flight (up to k) and
        # a constrained request's forced tokens after them (up to k + 1).
        window = 3 * self.num_tokens + 2
        together: dict[str, int] = {}  # id -> tokens to compute
        for req_id, (tokens, num_confirmed, limit) in contexts.items():
            if limit <= 0 or not tokens or self._row(req_id) is None:
                continue
            start = min(self._num_cached[req_id], len(tokens) - 1)
            if len(tokens) - start <= window <= len(tokens):
                together[req_id] = len(tokens) - start
            else:
                firsts[req_id] = self._catch_up([req_id], [tokens], start)
            self._num_cached[req_id] = min(num_confirmed, len(tokens))
        if together:
            ids = list(together)
            batch = self._catch_up(ids, [contexts[r][0] for r in ids], None,
                                   max(together.values()))
            firsts.update(zip(ids, batch[:, None]))
        if not firsts:
            return {}
        ids = list(firsts)
        limits = [contexts[r][2] for r in ids]
        tokens = torch.cat([firsts[r] for r in ids])
        drafts = [tokens]
        rows = torch.tensor([self._rows[r] for r in ids], device=self.device)
        starts = [len(contexts[r][0]) for r in ids]
        # A request past its own limit keeps decoding garbage with the others; its position
        # stops at the last slot (never a confirmed token's: it drafts only below it).
        last_slot = len(self._slots) - 1
        for step in range(max(limits) - 1):
            where = [min(s + step, last_slot) for s in starts]
            positions = torch.tensor(where, device=self.device)[:, None]
            logits = self.model.forward(tokens[:, None], positions, self.cache, rows,
                                        self._mask(positions, max(where) + 1))
            tokens = logits.argmax(-1)
            drafts.append(tokens)
        table = torch.stack(drafts, dim=1).tolist()
        return {r: table[i][:limit] for i, (r, limit) in enumerate(zip(ids, limits))}

    def _catch_up(self, ids: list[str], token_lists: list[list[int]], start: int | None,
                  width: int = 0) -> torch.Tensor:
        """Computes the tokens of each request from `start` (one request), or its last `width`
        tokens (several of equal width); returns the greedy next token of each [len(ids)]."""
        if start is not None:
            width = len(token_lists[0]) - start
        tokens = torch.tensor([t[len(t) - width:] for t in token_lists], device=self.device)
        ends = [len(t) for t in token_lists]
        positions = torch.tensor([[e - width + j for j in range(width)] for e in ends],
                                 device=self.device)
        rows = torch.tensor([self._rows[r] for r in ids], device=self.device)
        # From position 0 the tokens see only each other: plain causal attention, without a
        # [width, width] mask.
        mask = None if start == 0 else self._mask(positions, max(ends))
        logits = self.model.forward(tokens, positions, self.cache, rows, mask)
        return logits.argmax(-1)

    def _mask(self, positions: torch.Tensor, length: int) -> torch.Tensor:
        """[B, 1, T, length]: a token at position p sees the cache slots up to p."""
        return (self._slots[None, None, :length] <= positions[:, :, None])[:, None]

    def _row(self, req_id: str) -> int | None:
        row = self._rows.get(req_id)
        if row is None and self._free_rows:
            row = self._rows[req_id] = self._free_rows.pop()
            self._num_cached[req_id] = 0
        return row

    def release(self, req_id: str) -> None:
        """Frees the request's cache row (it finished). Unknown ids are ignored."""
        row = self._rows.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)
            self._num_cached.pop(req_id, None)
