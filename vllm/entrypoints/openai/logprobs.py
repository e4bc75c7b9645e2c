"""Logprobs in the API's JSON shapes: prompt logprobs, one token's logprob, finite numbers
only."""

from __future__ import annotations

from typing import Any

from vllm.logprobs import Logprob


def prompt_logprobs_json(
    scores: list[dict[int, Logprob] | None] | None,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """RequestOutput.prompt_logprobs in upstream's JSON shape (finite logprobs)."""
    if scores is None:
        return None
    return [
        None if entry is None else {
            str(t): {"logprob": finite(lp.logprob), "rank": lp.rank,
                     "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in scores
    ]


def token_logprob(entry: dict[int, Logprob], token_id: int) -> float | None:
    """The logprob of `token_id` at one position (None when it is not listed)."""
    found = entry.get(token_id)
    return None if found is None else found.logprob


def finite(logprob: float | None) -> float | None:
    """A logprob JSON can carry: -inf (a masked token) becomes -9999.0, as OpenAI reports it."""
    if logprob is None:
        return None
    if logprob != logprob or logprob < -9999.0:
        return -9999.0
    return logprob
