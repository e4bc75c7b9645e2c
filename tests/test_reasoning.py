"""Tests for vllm/reasoning/: the reasoning state of a reply, in token ids and in text."""

from __future__ import annotations

import pytest

from vllm.reasoning import ReasoningParser, ReasoningState, ReasoningStream

THINK, END, TURN = 151_667, 151_668, 151_644
ENDED, THINKING, UNDECIDED = ReasoningState.ENDED, ReasoningState.THINKING, ReasoningState.UNDECIDED


def parser(name: str = "qwen3") -> ReasoningParser:
    return ReasoningParser(name, name == "deepseek_r1", THINK, END, frozenset({TURN}))


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_create_reads_the_ids_from_the_tokenizer() -> None:
    vocab = {"<think>": 7, "</think>": 8, "<|im_start|>": 9, "a": 1}
    p = ReasoningParser.create("deepseek_r1", FakeTokenizer(vocab))
    assert (p.start_id, p.end_id, p.turn_ids, p.always_thinks) == (7, 8, {9}, True)
    assert not ReasoningParser.create("qwen3", FakeTokenizer(vocab)).always_thinks


def test_create_refuses_unknown_names_and_tokenizers_without_think_tokens() -> None:
    with pytest.raises(ValueError, match="--reasoning-parser: 'nope' is not one of"):
        ReasoningParser.create("nope", FakeTokenizer({}))
    with pytest.raises(ValueError, match="has no </think> token"):
        ReasoningParser.create("qwen3", FakeTokenizer({"<think>": 1}))


@pytest.mark.parametrize(
    ("name", "prompt", "state"),
    [
        ("qwen3", [1, 2], UNDECIDED),
        ("deepseek_r1", [1, 2], THINKING),
        ("qwen3", [1, THINK, 5], THINKING),  # the template opened the block
        ("qwen3", [1, THINK, 5, END, 6], ENDED),  # enable_thinking=False
        ("deepseek_r1", [THINK, END, 6], ENDED),
        ("qwen3", [THINK, 5, END, TURN, 6], UNDECIDED),  # an earlier turn's block
        ("deepseek_r1", [THINK, END, TURN, 6], THINKING),
        ("qwen3", [], UNDECIDED),
    ],
)
def test_initial_state(name: str, prompt: list[int], state: ReasoningState) -> None:
    assert parser(name).initial_state(prompt) == state


def test_advance_keeps_thinking_tokens_from_the_answer() -> None:
    p = parser()
    assert p.advance(UNDECIDED, THINK) == (THINKING, False)
    assert p.advance(UNDECIDED, 5) == (ENDED, True)
    assert p.advance(THINKING, 5) == (THINKING, False)
    assert p.advance(THINKING, THINK) == (THINKING, False)
    assert p.advance(THINKING, END) == (ENDED, False)
    assert p.advance(ENDED, END) == (ENDED, True)  # a second </think> is the answer's


@pytest.mark.parametrize(
    ("state", "text", "parts"),
    [
        (THINKING, "<think>hmm</think>{}", ("hmm", "{}")),
        (THINKING, "hmm</think>{}", ("hmm", "{}")),  # the prompt opened the block
        (THINKING, "<think>hmm", ("hmm", None)),  # budget hit while thinking
        (THINKING, "hmm</think>", ("hmm", None)),
        (THINKING, "a</think>b</think>c", ("a", "b</think>c")),
        (ENDED, "<think>x</think>y", (None, "<think>x</think>y")),
        (UNDECIDED, "", (None, None)),
    ],
)
def test_split(state: ReasoningState, text: str, parts: tuple) -> None:
    assert parser().split(state, text) == parts


def test_resolve_decides_by_the_first_token_only() -> None:
    p = parser()
    assert p.resolve(UNDECIDED, [THINK, 5]) == THINKING
    assert p.resolve(UNDECIDED, [5, THINK]) == ENDED
    assert p.resolve(UNDECIDED, []) == UNDECIDED
    assert p.resolve(THINKING, [5]) == THINKING


@pytest.mark.parametrize("cut", range(1, 8))
def test_stream_deltas_add_up_to_the_split(cut: int) -> None:
    """However the reply is cut into chunks, the deltas concatenate to the full split."""
    pieces = [("<think>", THINK), ("I ", 1), ("think", 2), ("</think>", END), ("{", 3),
              ('"a"', 4), ("}", 5)]
    p = parser()
    stream = ReasoningStream(p, UNDECIDED)
    chunks = [pieces[:cut], pieces[cut:]]
    reasoning, content = "", ""
    for chunk in chunks:
        r, c = stream.update("".join(t for t, _ in chunk), [i for _, i in chunk])
        reasoning += r or ""
        content += c or ""
    assert (reasoning, content) == ("I think", '{"a"}')


def test_stream_of_a_reply_that_does_not_think_is_all_content() -> None:
    stream = ReasoningStream(parser(), UNDECIDED)
    assert stream.update("{", [3]) == (None, "{")
    assert stream.update("<think>", [THINK]) == (None, "<think>")
