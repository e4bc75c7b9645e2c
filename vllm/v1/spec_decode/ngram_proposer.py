"""Prompt-lookup drafting: guess the next tokens by finding the latest tokens earlier on."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Drafts by n-gram lookup over a request's own tokens (prompt and output).

    The longest suffix of `prompt_lookup_max` down to `prompt_lookup_min` tokens that also
    occurs earlier is looked up; the tokens that followed its latest earlier occurrence with
    a full continuation (else its earliest) are the draft. Repetitive text (code edits,
    extraction, JSON keys) drafts well; free prose rarely matches and costs only the lookup.
    """

    def __init__(self, min_n: int, max_n: int, num_tokens: int) -> None:
        if not 1 <= min_n <= max_n or num_tokens < 1:
            raise ValueError(
                f"NgramProposer: need 1 <= min_n <= max_n and num_tokens >= 1, got "
                f"{min_n}, {max_n}, {num_tokens}"
            )
        self.min_n = min_n
        self.max_n = max_n
        self.num_tokens = num_tokens

    def propose_batch(
        self, contexts: dict[str, tuple[list[int], int, int]]
    ) -> dict[str, list[int]]:
        """Drafts to follow each request's tokens: `contexts[id]` is (tokens, how many are
        confirmed (unused here), most drafts). Returns only non-empty drafts."""
        drafts = {}
        for req_id, (tokens, _, limit) in contexts.items():
            if draft := self.propose(tokens, limit):
                drafts[req_id] = draft
        return drafts

    def release(self, req_id: str) -> None:
        """Nothing to free: lookups keep no per-request state."""

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Returns up to min(num_tokens, max_tokens) drafted tokens to follow `token_ids`
        ([] when no suffix occurs earlier). Pure: no state is kept between calls."""
        k = self.num_tokens if max_tokens is None else min(self.num_tokens, max_tokens)
        n_tokens = len(token_ids)
        if k <= 0 or n_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            suffix = tokens[n_tokens - n :]
            # Windows that end before the suffix starts (the suffix itself is no match).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: n_tokens - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                # The latest occurrence followed by k tokens, else the earliest (the longest
                # continuation): in a run of one repeated token, the latest occurrence is
                # followed by a single token.
                full = hits[hits + n + k <= n_tokens]
                start = int(full[-1] if len(full) else hits[0]) + n
                return tokens[start : start + k].tolist()
        return []
