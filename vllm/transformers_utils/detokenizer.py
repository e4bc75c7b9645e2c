"""Incremental detokenization for streaming, and stop-string search over new text."""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context, so tokenizers whose decode of a lone token drops a
# leading space (sentencepiece) still get the space right.
PROMPT_CONTEXT_TOKENS = 4
# Past this many held-back tokens, look for a point where the text is already final,
# so a run of undecodable bytes cannot make each update decode an ever longer window.
MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas for streaming.

    Text of tokens that end in an incomplete UTF-8 sequence is held back until a later
    token completes it (or `flush` releases it). Each update decodes only a short window
    of recent tokens. For a byte-level tokenizer, the deltas concatenate to
    `tokenizer.decode(all_output_ids, skip_special_tokens=...)`.
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # A prompt cut inside a character would garble the first output character.
            context, context_text = [], ""
        # Window ids: tokens[prefix:read] are already emitted (context for the next decode),
        # tokens[read:] are pending.
        self._tokens: list[int] = context
        self._prefix = 0
        self._read = len(context)
        self._prefix_text = context_text
        self._chunks: list[str] = []
        self._text = ""
        self._num_output_tokens = 0

    @property
    def output_text(self) -> str:
        """The text emitted so far (the concatenation of all returned deltas)."""
        if self._chunks:
            self._text += "".join(self._chunks)
            self._chunks.clear()
        return self._text

    @property
    def num_output_tokens(self) -> int:
        """How many output token ids `update` has received."""
        return self._num_output_tokens

    def update(self, new_token_ids: list[int]) -> str:
        """Add newly generated token ids; return the text they finalize (maybe "").

        Side effect: advances the internal window and appends the delta to `output_text`.
        """
        if not new_token_ids:
            return ""
        self._tokens.extend(new_token_ids)
        self._num_output_tokens += len(new_token_ids)
        text = self._decode(self._tokens[self._prefix :])
        if not text.endswith(REPLACEMENT_CHAR):
            return self._emit(text, len(self._tokens))
        if len(self._tokens) - self._read > MAX_HELD_TOKENS:
            return self._emit_final_part(text)
        return ""

    def flush(self) -> str:
        """Release all held-back text (invalid bytes become U+FFFD) and return it.

        Side effect: appends the delta to `output_text`; later updates continue after it.
        """
        if self._read == len(self._tokens):
            return ""
        return self._emit(self._decode(self._tokens[self._prefix :]), len(self._tokens))

    def _emit(self, text: str, end: int) -> str:
        """Emit `text` (the decode of tokens[prefix:end]) past the already emitted prefix."""
        delta = text[len(self._prefix_text) :] if text.startswith(self._prefix_text) else ""
        self._prefix = self._read
        self._read = end
        self._prefix_text = self._decode(self._tokens[self._prefix : self._read])
        self._trim()
        if delta:
            self._chunks.append(delta)
        return delta

    def _emit_final_part(self, text: str) -> str:
        """Emit the pending text up to a token boundary that later tokens cannot change.

        A split at `s` is final when decoding splits there too and at least two characters
        follow it: later bytes can only complete the last (incomplete) character.
        """
        lowest = max(self._read, len(self._tokens) - 2 * MAX_HELD_TOKENS)
        for split in range(len(self._tokens) - 1, lowest, -1):
            head = self._decode(self._tokens[self._prefix : split])
            tail = self._decode(self._tokens[split:])
            if len(tail) >= 2 and head + tail == text:
                return self._emit(head, split)
        return ""

    def _trim(self) -> None:
        """Drop ids before the window so memory stays bounded by the window size."""
        if self._prefix > 0:
            del self._tokens[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)


def find_stop_string(
    text: str, num_new_chars: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Find the first stop string that ends within the last `num_new_chars` chars of `text`.

    A match may start before the new chars. Among matches, the one that ends first wins
    (ties: the one that starts first, then list order), which is the match a char-by-char
    stream would have found. Returns (stop string, length to truncate `text` to: through
    the stop string if `include_stop_str_in_output`, else up to its start), or None.
    """
    num_new_chars = min(num_new_chars, len(text))
    if num_new_chars <= 0:
        return None
    best: tuple[int, int, str] | None = None
    for s in stop:
        if not s:
            continue
        start = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if start < 0:
            continue
        key = (start + len(s), start, s)
        if best is None or key[:2] < best[:2]:
            best = key
    if best is None:
        return None
    end, start, s = best
    return s, (end if include_stop_str_in_output else start)
