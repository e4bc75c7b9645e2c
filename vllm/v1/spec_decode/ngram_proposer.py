"""Prompt-lookup drafting: guess the next tokens by finding the latest tokens earlier on."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class _TokenBuffer:
    """A request's confirmed tokens as a growing numpy array, so that a lookup costs no
    conversion of the whole token list (confirmed tokens never change)."""

    def __init__(self) -> None:
        self.array = np.empty(64, dtype=np.int64)
        self.size = 0

    def view(self, tokens: Sequence[int], num_confirmed: int) -> np.ndarray:
        """`tokens` as an array: the first `num_confirmed` are appended to the buffer once;
        tokens after them (provisional, e.g. forced by a grammar) are copied for this call."""
        num_confirmed = min(num_confirmed, len(tokens))
        if num_confirmed < self.size:  # not this request's tokens: start over
            self.size = 0
        if num_confirmed > len(self.array):
            grown = np.empty(max(num_confirmed, 2 * len(self.array)), dtype=np.int64)
            grown[: self.size] = self.array[: self.size]
            self.array = grown
        self.array[self.size : num_confirmed] = tokens[self.size : num_confirmed]
        self.size = num_confirmed
        if num_confirmed == len(tokens):
            return self.array[:num_confirmed]
        return np.concatenate((self.array[:num_confirmed], tokens[num_confirmed:]))


class NgramProposer:
    """Drafts by n-gram lookup over a request's own tokens (prompt and output).

    The longest suffix of `prompt_lookup_max` down to `prompt_lookup_min` tokens that also
    occurs earlier is looked up; the tokens that followed its latest earlier occurrence with
    a full continuation are the draft. Without one, its latest occurrence is continued
    periodically past the end (a run of one token drafts that token). Repetitive text (code
    edits, extraction, JSON keys) drafts well; free prose rarely matches and costs only the
    lookup.
    Each request's confirmed tokens are kept as an array until `release`.
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
        self._buffers: dict[str, _TokenBuffer] = {}

    def propose_batch(
        self, contexts: dict[str, tuple[list[int], int, int]]
    ) -> dict[str, list[int]]:
        """Drafts to follow each request's tokens: `contexts[id]` is (tokens, how many are
        confirmed, most drafts, which may exceed num_tokens). Returns only non-empty drafts."""
        drafts = {}
        for req_id, (tokens, num_confirmed, limit) in contexts.items():
            if limit <= 0 or len(tokens) <= self.min_n:
                continue
            buffer = self._buffers.get(req_id)
            if buffer is None:
                buffer = self._buffers[req_id] = _TokenBuffer()
            if draft := self._lookup(buffer.view(tokens, num_confirmed), limit):
                drafts[req_id] = draft
        return drafts

    def release(self, req_id: str) -> None:
        """Forgets the request's token buffer."""
        self._buffers.pop(req_id, None)

    def _lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to k tokens to follow `tokens` (the caller bounds k)."""
        length = len(tokens)
        if k <= 0 or length <= self.min_n:
            return []
        max_n = min(self.max_n, length - 1)
        # Earlier positions holding the last token end a match of length >= 1 (the suffix
        # itself is no match); every candidate's match is extended backwards together.
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
        if len(ends) == 0:
            return []
        matched = np.ones(len(ends), dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for j in range(1, max_n):
            before = ends - j
            alive &= before >= 0
            alive &= tokens[np.maximum(before, 0)] == tokens[length - 1 - j]
            if not alive.any():
                break
            matched += alive
        for n in range(max_n, self.min_n - 1, -1):
            hits = ends[matched >= n]
            if len(hits):
                # The latest occurrence followed by k tokens. Else the latest one, whose
                # continuation runs into the end: the text repeats with period
                # `length - start` there (a run of one token has period 1), so the copy goes
                # on over the tokens it drafted, as an overlapping LZ77 copy does.
                full = hits[hits + 1 + k <= length]
                start = int(full[-1] if len(full) else hits[-1]) + 1
                draft = tokens[start : start + k].tolist()
                period = length - start
                while len(draft) < k:
                    draft.append(draft[len(draft) - period])
                return draft
        return []
