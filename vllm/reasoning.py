"""Reasoning models: where a reply's thinking ends, in tokens (engine) and in text (server).

A reasoning model writes `<think> ... </think>` before its answer. The engine must not apply
a structured-output constraint to the thinking, and the server returns the thinking as
`reasoning_content`, apart from `content`. Both decide from the same starting state, taken
from the end of the prompt (docs/architecture.md §5, "Reasoning"):

- ENDED: the prompt closed the thinking (Qwen3's template with `enable_thinking: false`
  writes an empty `<think>\\n\\n</think>` block): the reply is all answer.
- THINKING: the prompt opened a `<think>` block (DeepSeek-R1's template), or the parser says
  every reply starts thinking (`deepseek_r1`): the reply is thinking up to `</think>`.
- UNDECIDED (`qwen3` only): the reply thinks if and only if its first token is `<think>`.

A reply that never writes `</think>` is thinking to its end: `content` is null, and no
constraint was ever applied to it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

START = "<think>"
END = "</think>"
# Tokens that open a turn: the prompt's reasoning state is read after the last of them, so
# the thinking of earlier turns in a conversation does not count.
_TURN_MARKERS = ("<|im_start|>", "<｜Assistant｜>")


class ReasoningState(enum.IntEnum):
    """Where a reply stands with respect to its thinking block."""

    ENDED = 0
    THINKING = 1
    UNDECIDED = 2


@dataclass(frozen=True)
class ReasoningParser:
    """One `--reasoning-parser`: how a reply's thinking starts, in token ids and text."""

    name: str
    # True when a reply thinks unless the prompt closed the block (deepseek_r1); False when
    # only a reply that starts with <think> thinks (qwen3).
    always_thinks: bool
    start_id: int
    end_id: int
    turn_ids: frozenset[int]

    @classmethod
    def create(cls, name: str, tokenizer: Any) -> ReasoningParser:
        """The parser `name` for `tokenizer`.

        Raises ValueError naming --reasoning-parser for an unknown name or a tokenizer
        without single `<think>` / `</think>` tokens.
        """
        if name not in PARSERS:
            raise ValueError(
                f"--reasoning-parser: {name!r} is not one of {', '.join(sorted(PARSERS))}"
            )
        vocab = tokenizer.get_vocab()
        missing = [t for t in (START, END) if t not in vocab]
        if missing:
            raise ValueError(
                f"--reasoning-parser {name}: the tokenizer has no {' or '.join(missing)} token"
            )
        return cls(
            name=name,
            always_thinks=PARSERS[name],
            start_id=vocab[START],
            end_id=vocab[END],
            turn_ids=frozenset(vocab[t] for t in _TURN_MARKERS if t in vocab),
        )

    def initial_state(self, prompt_token_ids: list[int]) -> ReasoningState:
        """The state of a reply to this prompt before its first token."""
        for token in reversed(prompt_token_ids):
            if token == self.end_id:
                return ReasoningState.ENDED
            if token == self.start_id:
                return ReasoningState.THINKING
            if token in self.turn_ids:
                break
        return ReasoningState.THINKING if self.always_thinks else ReasoningState.UNDECIDED

    def advance(self, state: ReasoningState, token: int) -> tuple[ReasoningState, bool]:
        """The state after `token`, and whether `token` belongs to the answer (so the
        constraint must accept it)."""
        if state == ReasoningState.ENDED:
            return state, True
        if state == ReasoningState.UNDECIDED:
            if token == self.start_id:
                return ReasoningState.THINKING, False
            return ReasoningState.ENDED, True
        if token == self.end_id:
            return ReasoningState.ENDED, False
        return state, False

    def resolve(self, state: ReasoningState, token_ids: list[int]) -> ReasoningState:
        """`state` once the reply's first token is known: an UNDECIDED reply thinks if and
        only if that token is `<think>` (as the engine decided); unchanged otherwise."""
        if state != ReasoningState.UNDECIDED or not token_ids:
            return state
        return ReasoningState.THINKING if token_ids[0] == self.start_id else ReasoningState.ENDED

    def split(self, state: ReasoningState, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a reply's text that started in `state` (resolved
        by `resolve`; an UNDECIDED reply is treated as not having started).

        Either part is None when the reply has none of it (an empty answer after
        `</think>` is None, as is the answer of a reply that is still thinking).
        """
        if state == ReasoningState.ENDED:
            return None, text
        if state == ReasoningState.UNDECIDED:
            return None, None
        if text.startswith(START):
            text = text[len(START):]
        reasoning, found, content = text.partition(END)
        return reasoning, (content or None) if found else None


# name -> always_thinks
PARSERS: dict[str, bool] = {"qwen3": False, "deepseek_r1": True}


class ReasoningStream:
    """Splits one streamed reply into reasoning and content deltas.

    Each call gets the reply's next text and token ids and returns what is new in each part;
    the split is recomputed on the whole text, so a `</think>` arriving in any chunk is found.
    """

    def __init__(self, parser: ReasoningParser, state: ReasoningState) -> None:
        self._parser = parser
        self._state = state
        self._sent_reasoning = 0
        self._sent_content = 0
        self._text = ""

    def update(self, text: str, token_ids: list[int]) -> tuple[str | None, str | None]:
        """(new reasoning text, new content text) after the delta `text` / `token_ids`;
        None for a part with nothing new."""
        self._text += text
        self._state = self._parser.resolve(self._state, token_ids)
        reasoning, content = self._parser.split(self._state, self._text)
        new_reasoning = new_content = None
        if reasoning is not None and len(reasoning) > self._sent_reasoning:
            new_reasoning = reasoning[self._sent_reasoning:]
            self._sent_reasoning = len(reasoning)
        if content is not None and len(content) > self._sent_content:
            new_content = content[self._sent_content:]
            self._sent_content = len(content)
        return new_reasoning, new_content
