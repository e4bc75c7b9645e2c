"""Tests for vllm/transformers_utils/detokenizer.py: streaming deltas and stop strings."""

from __future__ import annotations

import random
from typing import Any

import pytest

from vllm.model_executor.model_loader.demo_model import build_demo_model
from vllm.transformers_utils.detokenizer import IncrementalDetokenizer, find_stop_string
from vllm.transformers_utils.tokenizer import get_tokenizer

TEXTS = [
    "Plain ASCII text, with punctuation!",
    "中文混合English，还有标点。龘靐齉",
    "Emoji run: 😀🎉👩‍👩‍👧‍👦🇯🇵🦄🧬 and math ∮ ∀x∈ℝ",
    "code:\n    for i in range(3):\n        print('ä', i)\n",
]


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tok() -> Any:
    return get_tokenizer(build_demo_model("demo-tiny"))


@pytest.fixture(scope="module")
def partial_ids(tok: Any) -> list[int]:
    """Base tokens that decode alone to U+FFFD (pieces of multi-byte characters)."""
    return [i for i in range(151643) if tok.decode([i]) == "\ufffd"]


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detok.update(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_stream_matches_decode(tok: Any, text: str) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert detok.output_text == text
    assert deltas[-1] == ""  # valid text: nothing left for flush
    assert all("\ufffd" not in d for d in deltas)


def test_partial_utf8_is_held_back(tok: Any) -> None:
    text = "🦄🧬龘"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the case under test
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.update([i]) for i in ids]
    assert "" in deltas[:-1]
    assert "".join(deltas) == text
    # Every prefix of the emitted text is whole characters of the final text.
    emitted = ""
    for d in deltas:
        emitted += d
        assert text.startswith(emitted)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])
def test_random_ids(tok: Any, partial_ids: list[int], skip: bool, chunk: int) -> None:
    # Random ids mixing ordinary, partial-UTF-8 and special tokens: invalid byte runs too.
    rng = random.Random(1234 + chunk)
    ids: list[int] = []
    for _ in range(400):
        r = rng.random()
        if r < 0.3:
            ids.append(rng.choice(partial_ids))
        elif r < 0.4:
            ids.append(rng.randrange(151643, 151669))
        else:
            ids.append(rng.randrange(151643))
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, prompt_token_ids=[9707, 1879])
    deltas = stream(detok, ids, chunk)
    assert "".join(deltas) == detok.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert detok.num_output_tokens == len(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok: Any, skip: bool) -> None:
    ids = tok.encode("<|im_start|>assistant\n答案<think>x</think>是42<|im_end|><|endoftext|>")
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    out = "".join(stream(detok, ids))
    assert out == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in out) is (not skip)
    assert "<think>x</think>" in out


def test_window_is_bounded(tok: Any, partial_ids: list[int]) -> None:
    # Long outputs, including a run of undecodable bytes, decode only short windows.
    ids = tok.encode("word " * 300) + [partial_ids[0]] * 40 + tok.encode("你好🦄" * 50)
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)
    out = "".join(stream(detok, ids))
    assert out == tok.decode(ids)
    assert max(counting.lengths[:-1]) <= 20  # the last call is flush's


def test_skipped_specials_inside_a_character(tok: Any) -> None:
    # Skipped special tokens between the pieces of one character must not split it, even
    # when more tokens are held back than the detokenizer normally waits for.
    pieces = next(ids for ids in map(tok.encode, "🦄🧬龘靐") if len(ids) > 1)
    ids = pieces[:1] + [151644] * 12 + pieces[1:] + tok.encode("ok")
    expected = tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in expected
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    assert "".join(stream(detok, ids)) == expected


def test_prompt_context_does_not_leak(tok: Any) -> None:
    prompt = tok.encode("<|im_start|>user\nSay hi 👋<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(" Hi there 👋!")
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False, prompt_token_ids=prompt)
    assert "".join(stream(detok, ids)) == " Hi there 👋!"


def test_flush_releases_invalid_bytes(tok: Any, partial_ids: list[int]) -> None:
    ids = tok.encode("ok") + [partial_ids[5]]
    detok = IncrementalDetokenizer(tok)
    assert detok.update(ids[:-1]) == "ok"
    assert detok.update(ids[-1:]) == ""
    assert detok.flush() == tok.decode(ids)[2:]
    assert detok.output_text == tok.decode(ids)
    assert detok.flush() == ""


def test_stop_across_boundary() -> None:
    # "STOP" starts in old text and ends in the 2 new chars.
    assert find_stop_string("abcSTOPxy", 4, ["STOP"], False) == ("STOP", 3)
    assert find_stop_string("abcSTOPxy", 4, ["STOP"], True) == ("STOP", 7)
    # Ending before the new chars: already checked earlier, not found again.
    assert find_stop_string("abcSTOPxyz", 3, ["STOP"], False) is None


def test_stop_earliest_wins() -> None:
    text = "hello world, goodbye"
    assert find_stop_string(text, len(text), ["goodbye", "world", "o"], False) == ("o", 4)
    assert find_stop_string(text, 8, ["bye", "good"], True) == ("good", 17)
    # Same end: the longer (earlier starting) match wins.
    assert find_stop_string(text, 8, ["bye", "odbye"], False) == ("odbye", 15)
    # A match that ends first wins over one that starts first.
    assert find_stop_string("xabcd", 5, ["xabcd", "ab"], False) == ("ab", 1)


def test_stop_none_and_edge_cases() -> None:
    assert find_stop_string("abc", 3, ["zz"], False) is None
    assert find_stop_string("abc", 0, ["c"], False) is None
    assert find_stop_string("abc", 10, ["", "a"], True) == ("a", 1)
    assert find_stop_string("", 1, ["a"], True) is None


def test_stop_matches_brute_force() -> None:
    # Feeding text char by char and stopping at the first hit gives the same answer.
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice("abc") for _ in range(12))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 3))) for _ in range(2)]
        expected = None
        for end in range(1, len(text) + 1):
            hits = [s for s in stops if text[:end].endswith(s)]
            if hits:
                s = max(hits, key=len)
                expected = (s, end - len(s))
                break
        got = None
        seen = 0
        for end in range(1, len(text) + 1, 3):
            chunk_end = min(end + 2, len(text))
            got = find_stop_string(text[:chunk_end], chunk_end - seen, stops, False)
            seen = chunk_end
            if got:
                break
        assert got == expected, (text, stops)


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_valid_text_split_into_byte_tokens_never_shows_replacement_chars(
    tok: Any, chunk: int
) -> None:
    # Valid UTF-8 written one byte per token (as a constrained sampler may): runs of many
    # pending tokens (past the held-back limit) must still never emit a split character.
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = tok.get_vocab()
    byte_token = {b: vocab[c] for b, c in bytes_to_unicode().items()}
    rng = random.Random(77 + chunk)
    alphabet = "a é€𝄞😀한\U0010fffd\ud7ff\ue000"
    text = "".join(rng.choice(alphabet) for _ in range(300))
    ids: list[int] = []
    for ch in text:
        raw = ch.encode("utf-8")
        # Each character as single-byte tokens, or as the tokenizer's own tokens.
        ids += [byte_token[b] for b in raw] if rng.random() < 0.7 else tok.encode(ch)
    assert tok.decode(ids) == text
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, ids, chunk)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
