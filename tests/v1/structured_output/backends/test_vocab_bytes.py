"""The bytes each token writes, for the outlines and lm-format-enforcer backends."""

from __future__ import annotations

from typing import Any

import pytest

from vllm.v1.structured_output.backends.vocab_bytes import VocabBytes

from tests.v1.structured_output.conftest import EOS_IDS, VOCAB_SIZE


def test_qwen_byte_level_vocabulary(tokenizer: Any, pieces: list[bytes]) -> None:
    vocab = VocabBytes.build(tokenizer, VOCAB_SIZE, EOS_IDS)
    assert vocab.stop_ids == tuple(sorted(EOS_IDS))
    space = tokenizer.encode(" the", add_special_tokens=False)[0]
    assert vocab.pieces[space] == b" the"
    assert vocab.pieces[127] == b"\xc3"  # one byte of a character
    assert vocab.pieces[151667] == b"<think>"  # an added token that is text
    assert 151644 not in vocab.pieces and 151644 in vocab.masked_token_ids  # <|im_start|>
    assert set(range(151669, VOCAB_SIZE)) <= vocab.masked_token_ids
    assert vocab.masked_token_ids.isdisjoint(EOS_IDS) and not set(EOS_IDS) & vocab.pieces.keys()
    # Independent decoding (the walker's) agrees on every text token.
    assert all(pieces[i] == piece for i, piece in vocab.pieces.items())


class _Tokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self._vocab = vocab
        self.all_special_ids = [0]

    def get_vocab(self) -> dict[str, int]:
        return self._vocab


def test_sentencepiece_byte_fallback() -> None:
    tok = _Tokenizer({"</s>": 0, "▁the": 1, "<0x0A>": 2, "é": 3, "<0xC3>": 4})
    vocab = VocabBytes.build(tok, 6, [0])
    assert vocab.pieces == {1: b" the", 2: b"\n", 3: "é".encode(), 4: b"\xc3"}
    assert vocab.masked_token_ids == frozenset({5})


def test_no_stop_token_in_the_vocabulary_is_an_error() -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        VocabBytes.build(_Tokenizer({"a": 0}), 1, [5])
