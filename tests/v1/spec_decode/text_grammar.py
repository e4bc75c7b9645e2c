"""A tiny text grammar and tokenizer for fast-forward tests: the output is one of a few
strings, tokens are pieces of text, and the forced text is what every remaining option
shares."""

from __future__ import annotations

import numpy as np

from vllm.v1.structured_output.backends.base import StructuredOutputGrammar

STOP = 0
# Token id -> text. Longest-match tokenization of '{"name":"' is 1 2 3; the "backend"
# spells forced text one character at a time where it can.
VOCAB = {
    STOP: "",
    1: '{"', 2: "name", 3: '":"', 4: '"', 5: "{", 6: "n", 7: "a", 8: "m", 9: "e",
    10: ":", 11: "x", 12: "y", 13: '"}', 14: "}", 15: "<pre>",
}
VOCAB_SIZE = 32


class Tokenizer:
    """Longest match first over VOCAB; `prefix` is prepended to every encoding (as some
    tokenizers add a start-of-text piece)."""

    def __init__(self, prefix: list[int] | None = None) -> None:
        self.prefix = prefix or []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`."""
        ids = list(self.prefix)
        pieces = sorted(((t, i) for i, t in VOCAB.items() if t), key=lambda p: -len(p[0]))
        while text:
            piece, token = next((t, i) for t, i in pieces if text.startswith(t))
            ids.append(token)
            text = text[len(piece):]
        return ids


class TextGrammar(StructuredOutputGrammar):
    """Accepts token sequences that spell one of `options`, then STOP."""

    def __init__(self, options: list[str]) -> None:
        self.options = options
        self.tokens: list[int] = []
        self.terminated = False

    @property
    def text(self) -> str:
        return "".join(VOCAB[t] for t in self.tokens)

    def _ok(self, text: str, token: int) -> bool:
        if token == STOP:
            return text in self.options
        piece = VOCAB.get(token)
        return bool(piece) and any(o.startswith(text + piece) for o in self.options)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for token in tokens:
            if self.terminated or not self._ok(self.text, token):
                return False
            self.tokens.append(token)
            self.terminated = token == STOP
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        text, out = self.text, []
        if self.terminated:
            return out
        for token in tokens:
            if not self._ok(text, token):
                break
            out.append(token)
            if token == STOP:
                break
            text += VOCAB[token]
        return out

    def forced_string(self) -> str:
        if self.terminated:
            return ""
        text = self.text
        rests = [o[len(text):] for o in self.options if o.startswith(text)]
        common = rests[0]
        for rest in rests[1:]:
            while not rest.startswith(common):
                common = common[:-1]
        return common

    def jump_forward_tokens(self) -> list[int]:
        # One character per token where the vocabulary has it (not the canonical spelling).
        singles = {t: i for i, t in VOCAB.items() if len(t) == 1}
        out = []
        for char in self.forced_string():
            if char not in singles:
                break
            out.append(singles[char])
        return out

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            del self.tokens[-num_tokens:]
            self.terminated = False

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] = 0
        for token in range(len(VOCAB)):
            if self._ok(self.text, token):
                bitmask[row, token // 32] |= np.int32(1 << token) if token < 31 else 0

    def is_terminated(self) -> bool:
        return self.terminated

    @property
    def num_processed_tokens(self) -> int:
        return len(self.tokens)
