"""Log probabilities of generated tokens, as upstream vLLM's users read them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """One token's log probability at one position of an output."""

    logprob: float
    # 1 = the most likely token at that position (ties share the best rank).
    rank: int | None = None
    # The token's text (None when the request did not detokenize).
    decoded_token: str | None = None


# Per output position: token id -> Logprob, for the sampled token and the top-k alternatives.
PositionLogprobs = dict[int, Logprob]
SampleLogprobs = list[PositionLogprobs]
