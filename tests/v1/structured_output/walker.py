"""Random walks over the tokens a grammar allows, to exercise it like a sampler would."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from transformers.convert_slow_tokenizer import bytes_to_unicode

from vllm.v1.structured_output.backends.base import StructuredOutputGrammar

# Tokens that end a string, object, array or parenthesis: preferred when finishing a walk.
_CLOSERS = (b'"', b"}", b"]", b")")


def allowed_token_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """Returns the token ids whose bits are set in one int32 bitmask row (bit j of word w is
    token 32 * w + j), decoded independently of xgrammar."""
    row = np.ascontiguousarray(row)
    words = np.flatnonzero(row)
    if 2 * len(words) > len(row):  # most tokens allowed: unpack the whole row
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")
        return np.flatnonzero(bits[:vocab_size])
    # Few words set (outside strings, a JSON grammar allows a handful of tokens): unpacking
    # only those is ~15x faster than the 150k bits of the whole row, in the same order.
    bits = np.unpackbits(row[words].view(np.uint8), bitorder="little").reshape(len(words), 32)
    word, bit = np.nonzero(bits)
    ids = words[word] * 32 + bit
    return ids[ids < vocab_size]


def token_bytes(tokenizer: object) -> list[bytes]:
    """Returns the raw bytes of every token id of a byte-level BPE tokenizer."""
    decode = {c: b for b, c in bytes_to_unicode().items()}
    vocab: dict[str, int] = tokenizer.get_vocab()  # type: ignore[attr-defined]
    out = [b""] * (max(vocab.values()) + 1)
    for text, idx in vocab.items():
        if all(c in decode for c in text):
            out[idx] = bytes(decode[c] for c in text)
        else:
            out[idx] = text.encode()
    return out


@dataclass
class WalkVocab:
    """What a walk needs to know about the vocabulary."""

    vocab_size: int
    stop_ids: np.ndarray
    # Per token id: a one-byte closing token, a one-byte non-whitespace token.
    is_closer: np.ndarray
    is_short: np.ndarray

    @classmethod
    def build(cls, pieces: list[bytes], vocab_size: int, stop_ids: list[int]) -> WalkVocab:
        """Classifies every token of `pieces` (ids past it are never short or closing)."""
        is_closer = np.zeros(vocab_size, dtype=bool)
        is_short = np.zeros(vocab_size, dtype=bool)
        for idx, piece in enumerate(pieces[:vocab_size]):
            is_closer[idx] = piece in _CLOSERS
            is_short[idx] = len(piece) == 1 and not piece.isspace()
        return cls(vocab_size, np.array(stop_ids), is_closer, is_short)


def random_walk(
    grammar: StructuredOutputGrammar,
    vocab: WalkVocab,
    rng: np.random.Generator,
    *,
    max_steps: int = 600,
    finish_after: int = 30,
    stop_prob: float = 0.2,
) -> tuple[list[int], bool]:
    """Samples allowed tokens uniformly until a stop token (returned last) or max_steps.

    After `finish_after` steps it steers toward the end: stop whenever allowed, else prefer
    closing tokens, else one-byte tokens. Returns (tokens, stopped). Asserts that the
    grammar allows at least one token at every step and accepts every token it allowed.
    """
    bitmask = np.zeros((1, (vocab.vocab_size + 31) // 32), dtype=np.int32)
    tokens: list[int] = []
    for step in range(max_steps):
        grammar.fill_bitmask(bitmask, 0)
        ids = allowed_token_ids(bitmask[0], vocab.vocab_size)
        assert len(ids) > 0, f"no token allowed after {tokens}"
        stop = np.isin(ids, vocab.stop_ids)
        stops, rest = ids[stop], ids[~stop]
        finishing = step >= finish_after
        if len(stops) and (not len(rest) or finishing or rng.random() < stop_prob):
            token = int(stops[0])
            assert grammar.accept_tokens("walk", [token])
            return tokens + [token], True
        candidates = rest
        if finishing:
            closers = rest[vocab.is_closer[rest]]
            short = rest[vocab.is_short[rest]]
            if len(closers) and rng.random() < 0.7:
                candidates = closers
            elif len(short):
                candidates = short
        token = int(candidates[rng.integers(len(candidates))])
        assert grammar.accept_tokens("walk", [token]), f"allowed token {token} was rejected"
        tokens.append(token)
    return tokens, False
