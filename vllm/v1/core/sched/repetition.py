"""Repetition detection: notices, token by token, when a request's output ends in one pattern
repeated back to back (`SamplingParams.repetition_detection`), so the request stops instead of
looping until max_tokens."""

from __future__ import annotations

import numpy as np

from vllm.sampling_params import RepetitionDetectionParams

# What a request stopped by repetition reports as its stop_reason (upstream vLLM's string).
REPETITION_STOP_REASON = "repetition_detected"


class RepetitionDetector:
    """Watches one request's output tokens, fed one at a time in order.

    The output ends in a pattern of length L repeated `min_count` times exactly when each of
    its last L * (min_count - 1) tokens equals the token L positions before it. For every L
    in [min_pattern_size, max_pattern_size] the detector keeps how many tokens in a row,
    ending at the newest, equal the token L before them, so each token costs one vectorized
    comparison over the pattern sizes, whatever the output length. Memory grows with the
    output (at most its length plus the number of pattern sizes), not with the limits.
    """

    def __init__(self, params: RepetitionDetectionParams) -> None:
        """Raises ValueError for params with detection off (max_pattern_size 0)."""
        if not params.enabled:
            raise ValueError("repetition detection is off (max_pattern_size 0)")
        self.min_size = max(1, params.min_pattern_size)
        self.max_size = params.max_pattern_size
        self.min_count = params.min_count
        # The output so far (capacity doubles as it grows).
        self._tokens = np.zeros(64, dtype=np.int64)
        self._num_tokens = 0
        # _runs[i]: tokens in a row, ending at the newest, equal to the one min_size + i
        # before them; only sizes the output is already longer than are tracked.
        self._runs = np.zeros(0, dtype=np.int64)
        # _needed[i]: the run that proves a repetition of pattern size min_size + i.
        self._needed = np.zeros(0, dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        """Tokens fed so far."""
        return self._num_tokens

    def push(self, token: int) -> bool:
        """Feeds the next output token; True when the output now ends in a repetition."""
        n = self._num_tokens
        if n == len(self._tokens):
            self._tokens = np.concatenate([self._tokens, np.zeros_like(self._tokens)])
        self._tokens[n] = token
        self._num_tokens = n + 1
        # Pattern sizes min_size..largest can be compared with an earlier token.
        largest = min(self.max_size, n)
        width = largest - self.min_size + 1
        if width <= 0:
            return False
        if width > len(self._runs):
            self._grow(width)
        # The tokens min_size, min_size + 1, ..., largest positions before the new one.
        earlier = self._tokens[n - largest:n - self.min_size + 1][::-1]
        runs = self._runs[:width]
        runs += 1
        runs[earlier != token] = 0
        return bool((runs >= self._needed[:width]).any())

    def _grow(self, width: int) -> None:
        """Tracks pattern sizes up to min_size + width - 1 (new sizes start with no run: no
        token before the newest could be compared with one that far back)."""
        size = min(max(width, 2 * len(self._runs)), self.max_size - self.min_size + 1)
        runs = np.zeros(size, dtype=np.int64)
        runs[:len(self._runs)] = self._runs
        self._runs = runs
        sizes = np.arange(self.min_size, self.min_size + size, dtype=np.int64)
        self._needed = sizes * (self.min_count - 1)

