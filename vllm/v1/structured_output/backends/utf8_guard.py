"""The UTF-8 guard: masks the tokens that would make a constrained output invalid UTF-8.

xgrammar 0.2.9 accepts a few byte sequences that are not valid UTF-8 (encoded surrogates
`ED A0..BF xx` everywhere; overlong `E0 80..9F xx` and `F0 80..8F xx xx` inside JSON-schema
patterns). `Utf8Guard` tracks, per token, whether its last byte is a lead byte that restricts
the next one, and holds the bitmask rows that clear the tokens that may not follow it.

Separate from the backend because it works on the vocabulary's bytes alone (numpy); xgrammar
is imported only to read its vocabulary view in `Utf8Guard.from_vocab`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import xgrammar as xgr

# UTF-8 lead bytes after which only part of the continuation range may follow (RFC 3629):
# E0 needs A0..BF (else overlong), ED 80..9F (else a surrogate), F0 90..BF (else overlong),
# F4 80..8F (else past U+10FFFF). Index = the guard state; 0 = no restriction.
_RESTRICTED_LEADS = (0xE0, 0xED, 0xF0, 0xF4)
_FORBIDDEN_NEXT = ((0x80, 0x9F), (0xA0, 0xBF), (0x80, 0x8F), (0x90, 0xBF))


class Utf8Guard:
    """Keeps outputs valid UTF-8 where xgrammar 0.2.9 accepts invalid byte sequences.

    The state after a token is the index (1-4) of `_RESTRICTED_LEADS` when the token's last
    byte is one of those lead bytes, else 0; `allowed[state]` is a bitmask row that clears
    the tokens whose first byte may not follow that lead. A restricted pair inside one token
    is not guarded: BPE vocabularies learnt from valid text hold none.
    """

    def __init__(self, first_bytes: np.ndarray, last_bytes: np.ndarray) -> None:
        vocab_size = len(first_bytes)
        self.state_after = np.zeros(vocab_size, dtype=np.int8)
        self.forbidden: list[np.ndarray] = [np.zeros(vocab_size, dtype=bool)]
        words = (vocab_size + 31) // 32
        self.allowed = np.full((len(_RESTRICTED_LEADS) + 1, words), -1, dtype=np.int32)
        for state, (lead, (lo, hi)) in enumerate(zip(_RESTRICTED_LEADS, _FORBIDDEN_NEXT), 1):
            self.state_after[last_bytes == lead] = state
            forbidden = (first_bytes >= lo) & (first_bytes <= hi)
            self.forbidden.append(forbidden)
            bits = np.zeros(words * 32, dtype=np.uint8)
            bits[:vocab_size] = ~forbidden
            self.allowed[state] = np.packbits(bits, bitorder="little").view(np.int32)

    @classmethod
    def from_vocab(cls, info: xgr.TokenizerInfo, encoded: list[str]) -> Utf8Guard:
        """Builds the guard from xgrammar's vocabulary view (`encoded`: the HF token strings,
        "" for masked ids)."""
        import xgrammar as xgr  # deferred: see the module docstring

        n = len(encoded)
        first = np.zeros(n, dtype=np.uint8)
        last = np.zeros(n, dtype=np.uint8)
        if info.vocab_type == xgr.VocabType.BYTE_LEVEL:
            # Each character of a byte-level token stands for one byte: reading just the ends
            # takes a fraction of the second that decoding the whole vocabulary does.
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            to_byte = {c: b for b, c in bytes_to_unicode().items()}
            for i, token in enumerate(encoded):
                if token:
                    first[i] = to_byte.get(token[0], ord(token[0]) & 0xFF)
                    last[i] = to_byte.get(token[-1], ord(token[-1]) & 0xFF)
        else:
            for i, raw in enumerate(info.decoded_vocab[:n]):
                if raw and encoded[i]:
                    first[i], last[i] = raw[0], raw[-1]
        return cls(first, last)
