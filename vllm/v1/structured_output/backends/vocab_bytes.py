"""The bytes each token writes, for backends that match bytes or text themselves (outlines,
lm-format-enforcer) instead of reading the tokenizer through a library of their own.

Three vocabulary styles are read: byte-level BPE (GPT-2, Qwen, Llama 3: each character of a
token stands for one byte, `Ġ` for a space), SentencePiece with byte fallback (Llama 2,
Mistral: `▁` for a space, `<0x0A>` for one raw byte), and anything else, whose tokens are
their own text. Tokens that are never text (the tokenizer's special tokens, see
`control_token_ids`), the stop tokens and ids past `vocab_size` get no bytes: a backend masks
them, and accepts a stop token only where the constraint may end.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.transformers_utils.tokenizer import control_token_ids
from vllm.v1.structured_output.backends.base import tokenizer_vocab

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable character standing for a byte back to the byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


@dataclass(frozen=True)
class VocabBytes:
    """The text tokens of one vocabulary and the ids a constraint never allows."""

    # Token id -> the bytes it writes, for every token that is text.
    pieces: dict[int, bytes]
    # Stop token ids inside the vocabulary, sorted.
    stop_ids: tuple[int, ...]
    # Ids below vocab_size that are neither text nor a stop token.
    masked_token_ids: frozenset[int]
    vocab_size: int

    @classmethod
    def build(cls, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> VocabBytes:
        """Reads the tokenizer's vocabulary (about a second for 150k tokens).

        Raises ValueError when the tokenizer has no vocabulary, vocab_size < 1, or no stop
        token lies inside the vocabulary (a constraint could then never end).
        """
        if vocab_size < 1:
            raise ValueError(f"vocab_size: must be positive, got {vocab_size}")
        stops = tuple(sorted({int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size}))
        if not stops:
            raise ValueError(
                f"stop_token_ids: none of {list(stop_token_ids)} is below vocab_size {vocab_size}"
            )
        vocab = tokenizer_vocab(tokenizer)
        control = control_token_ids(tokenizer)
        decode = _piece_decoder(vocab)
        pieces: dict[int, bytes] = {}
        for token, idx in vocab.items():
            if 0 <= idx < vocab_size and idx not in control and idx not in stops:
                piece = decode(token)
                if piece:
                    pieces[idx] = piece
        masked = frozenset(set(range(vocab_size)) - pieces.keys() - set(stops))
        return cls(pieces, stops, masked, vocab_size)


def _piece_decoder(vocab: dict[str, int]) -> Any:
    """The function from a token's string to its bytes, chosen by the vocabulary's style."""
    if "Ġ" in vocab or "Ċ" in vocab:  # byte-level BPE: a space and a newline token
        table = _byte_decoder()

        def byte_level(token: str) -> bytes:
            if all(c in table for c in token):
                return bytes(table[c] for c in token)
            return token.encode("utf-8")  # an added token written as plain text

        return byte_level
    if "<0x0A>" in vocab:  # SentencePiece with byte fallback

        def sentencepiece(token: str) -> bytes:
            match = _BYTE_TOKEN.fullmatch(token)
            if match:
                return bytes([int(match.group(1), 16)])
            return token.replace("▁", " ").encode("utf-8")

        return sentencepiece
    return lambda token: token.encode("utf-8")
