"""Grammar fast-forward: its modes, which one a request runs in, and canonical forced tokens.

When a constrained request's grammar forces the next characters (a JSON key, `": "`, a
closing brace), those tokens need no choice of the model. Fast-forward drafts them as
certain tokens, so that many enter one forward pass and none is sampled
(docs/architecture.md §11):

- `exact`: the tokens the grammar allows one at a time, each the only token its position
  allows (a bitmask row with a single bit), are appended without sampling. Sampling there
  could give nothing else, so outputs are exactly those without fast-forward, and the
  runner computes no logits, no bitmask row and no sample for those positions: only the
  position after the run samples. It needs nothing but bitmasks, so it works with every
  grammar backend.
- `canonical`: the forced text is tokenized canonically with the engine's tokenizer (as
  the tokenizer would encode that text alone) and each of those tokens is the only token its
  position allows, so every one is kept. Outputs stay valid but are not token-identical to
  free decoding: where the forced text ends, the model might have merged it with what
  follows into a longer token. A trained model expects the canonical tokenization.
- `off`: nothing forced is drafted.

The modes' names and parsing are in vllm/options.py, where the config and the request
parameters check them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm.exceptions import InvalidRequestError
from vllm.options import EXACT, OFF, fast_forward_rank

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request
    from vllm.v1.structured_output.backends.base import StructuredOutputGrammar


def server_mode(config: VllmConfig) -> str:
    """The most a request may ask for on this server. With --speculative-config and the
    option off, drafts still start with the tokens positions allow alone (exact)."""
    mode = config.structured_outputs_config.fast_forward
    if mode == OFF and config.speculative_config is not None:
        return EXACT
    return mode


def check_request_mode(requested: str | None, allowed: str) -> None:
    """Refuses a request mode above the server's `allowed` one: canonical changes outputs,
    so only the operator may allow it, and without speculative decoding nothing drafts.
    Raises InvalidRequestError naming structured_outputs.fast_forward."""
    if requested is not None and fast_forward_rank(requested) > fast_forward_rank(allowed):
        raise InvalidRequestError(
            "structured_outputs.fast_forward",
            f"{requested!r} is not enabled on this server (it allows up to {allowed!r}; "
            f"start it with --structured-outputs-config.fast_forward {requested})",
        )


class FastForward:
    """The server's mode and the canonical tokenization of forced text, shared by the
    drafter and the bitmask rows of one engine.

    `load_tokenizer` is called on the first canonical tokenization (the engine's tokenizer
    is loaded lazily by the structured-output manager); `allocate_row` returns a one-row
    bitmask the backend fills (called once, on the first exact fast-forward).
    """

    def __init__(self, allowed: str, load_tokenizer: Callable[[], Any],
                 allocate_row: Callable[[], np.ndarray] | None = None) -> None:
        self.allowed = allowed
        self._load_tokenizer = load_tokenizer
        self._encode: Callable[[str], list[int]] | None = None
        self._allocate_row = allocate_row
        self._row: np.ndarray | None = None

    def mode(self, request: Request) -> str:
        """The request's mode: its own (admission checked it is allowed), else the
        server's; `off` for an unconstrained request."""
        structured_req = request.structured_output_request
        if structured_req is None:
            return OFF
        requested = structured_req.params.fast_forward
        if requested is None:
            return self.allowed
        # Clamped in case the request skipped the admission check (a direct engine call).
        return min(requested, self.allowed, key=fast_forward_rank)

    def canonical_tokens(self, grammar: StructuredOutputGrammar, limit: int) -> list[int]:
        """At most `limit` tokens of the text `grammar` forces next, as the engine's tokenizer
        encodes that text, cut at the first token the grammar refuses; when it refuses the
        first (a tokenizer that adds a prefix, a token the grammar masks), the backend's own
        forced tokens instead. [] when nothing is forced. The grammar is left as it was."""
        if limit <= 0:
            return []
        text = grammar.forced_string()
        if not text:
            return []
        if self._encode is None:
            tokenizer = self._load_tokenizer()

            def encode(text: str) -> list[int]:
                return list(tokenizer.encode(text, add_special_tokens=False))

            self._encode = encode
        tokens = grammar.validate_tokens(self._encode(text)[:limit])
        return tokens or grammar.jump_forward_tokens()[:limit]

    def single_tokens(self, req_id: str, grammar: StructuredOutputGrammar, limit: int
                      ) -> list[int]:
        """At most `limit` tokens that `grammar` allows one at a time from its state: each is
        the only token its bitmask row allows after the ones before it (exact mode). Ends
        after a token that terminates the grammar. The grammar is left as it was.

        Costs one bitmask fill per token plus one for the position that ends the run, the
        fills decoding without fast-forward makes at the same positions."""
        if limit <= 0:
            return []
        if self._row is None:
            if self._allocate_row is None:
                raise RuntimeError("exact fast-forward: no bitmask row to fill (allocate_row)")
            self._row = self._allocate_row()
        row = self._row
        tokens: list[int] = []
        try:
            while len(tokens) < limit and not grammar.is_terminated():
                grammar.fill_bitmask(row, 0)
                token = only_token(row[0])
                if token is None or not grammar.accept_tokens(req_id, [token]):
                    break
                tokens.append(token)
        finally:
            grammar.rollback(len(tokens))
        return tokens


def only_token(words: np.ndarray) -> int | None:
    """The id of the one token a bitmask row (int32 words) allows, None unless exactly one."""
    # Counting first: most rows allow many tokens, and counting needs no index array.
    if np.count_nonzero(words) != 1:
        return None
    nonzero = np.flatnonzero(words)
    word = int(words[nonzero[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(nonzero[0]) * 32 + word.bit_length() - 1
