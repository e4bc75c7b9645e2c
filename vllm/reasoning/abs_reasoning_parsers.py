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

`ReasoningParser` is upstream vLLM's base class (constructed with a tokenizer, with
`is_reasoning_end`, `extract_content_ids`, `extract_reasoning_content` and its streaming
form); `ReasoningParserManager` maps `--reasoning-parser` names to parser classes, and a
user's module registers its own with `@ReasoningParserManager.register_module("name")`.
"""

from __future__ import annotations

import enum
import importlib.util
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

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


class ReasoningParser:
    """One `--reasoning-parser`: how a reply's thinking starts and ends, in token ids and text.

    A subclass says what its model writes through class attributes: `start_token` and
    `end_token` (each must be one token of the vocabulary) and `always_thinks` (True when
    every reply starts inside the thinking block unless the prompt closed it, as DeepSeek-R1's
    template does; False when only a reply whose first token is `start_token` thinks, as
    Qwen3's). The engine applies a structured-output constraint from the token after
    `end_token`; the server splits text with the same markers.

    Built as upstream builds it, `Parser(tokenizer)`; or, where the token ids are already
    known (tests, the engine's own bookkeeping), `ReasoningParser(name, always_thinks,
    start_id, end_id, turn_ids)`.
    """

    start_token: str = START
    end_token: str = END
    always_thinks: bool = False
    # The name it is registered under (set by ReasoningParserManager.register_module).
    name: str = ""

    def __init__(self, tokenizer: Any, *ids: Any) -> None:
        if isinstance(tokenizer, str):
            # The explicit form: (name, always_thinks, start_id, end_id, turn_ids).
            always_thinks, start_id, end_id, turn_ids = ids
            self.model_tokenizer: Any = None
            self.name = tokenizer
            self.always_thinks = bool(always_thinks)
            self.start_id: int = start_id
            self.end_id: int = end_id
            self.turn_ids: frozenset[int] = frozenset(turn_ids)
            return
        self.model_tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        missing = [t for t in (self.start_token, self.end_token) if t not in vocab]
        if missing:
            raise ValueError(
                f"--reasoning-parser {self.name or type(self).__name__}: the tokenizer has no "
                f"{' or '.join(missing)} token"
            )
        self.start_id = vocab[self.start_token]
        self.end_id = vocab[self.end_token]
        self.turn_ids = frozenset(vocab[t] for t in _TURN_MARKERS if t in vocab)

    @classmethod
    def create(cls, name: str, tokenizer: Any) -> ReasoningParser:
        """The parser registered as `name`, for `tokenizer`.

        Raises ValueError naming --reasoning-parser for an unknown name or a tokenizer
        without single start / end tokens.
        """
        return ReasoningParserManager.get_reasoning_parser(name)(tokenizer)

    @property
    def vocab(self) -> dict[str, int]:
        """The tokenizer's vocabulary (token text -> id)."""
        return self.model_tokenizer.get_vocab()

    # ------------------------------------------------------------------ token state (engine)

    def initial_state(self, prompt_token_ids: Sequence[int]) -> ReasoningState:
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

    def resolve(self, state: ReasoningState, token_ids: Sequence[int]) -> ReasoningState:
        """`state` once the reply's first token is known: an UNDECIDED reply thinks if and
        only if that token is the start token (as the engine decided); unchanged otherwise."""
        if state != ReasoningState.UNDECIDED or not token_ids:
            return state
        return ReasoningState.THINKING if token_ids[0] == self.start_id else ReasoningState.ENDED

    def split(self, state: ReasoningState, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a reply's text that started in `state` (resolved
        by `resolve`; an UNDECIDED reply is treated as not having started).

        Either part is None when the reply has none of it (an empty answer after the end
        token is None, as is the answer of a reply that is still thinking).
        """
        if state == ReasoningState.ENDED:
            return None, text
        if state == ReasoningState.UNDECIDED:
            return None, None
        if text.startswith(self.start_token):
            text = text[len(self.start_token):]
        reasoning, found, content = text.partition(self.end_token)
        return reasoning, (content or None) if found else None

    # ------------------------------------------------------------------ upstream's interface

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """True when the thinking is over by the end of `input_ids` (the last start or end
        token in them is the end token)."""
        for token in reversed(input_ids):
            if token == self.end_id:
                return True
            if token == self.start_id:
                return False
        return False

    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        """The answer's token ids: those after the last end token (none before it)."""
        for i in range(len(input_ids) - 1, -1, -1):
            if input_ids[i] == self.end_id:
                return list(input_ids[i + 1:])
        return []

    def _text_state(self, text: str) -> ReasoningState:
        """The starting state of a reply known only by its text (no prompt ids)."""
        if self.always_thinks or text.startswith(self.start_token):
            return ReasoningState.THINKING
        return ReasoningState.ENDED

    def extract_reasoning_content(
        self,
        model_output: str,
        request: Any = None,
        prompt_token_ids: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply's text.

        Takes what upstream's versions pass, positionally or by name: `request` (the chat or
        Responses request; the split does not depend on it) and `prompt_token_ids`, which,
        when given, decide where the reply starts as the engine decides it (a prompt that
        opened `<think>` or closed the block); without them the text decides. Any other
        keyword argument a version passes is accepted and does not change the split.
        """
        state = self._text_state(model_output)
        if prompt_token_ids is not None:
            from_prompt = self.initial_state(prompt_token_ids)
            if from_prompt != ReasoningState.UNDECIDED:
                state = from_prompt
        return self.split(state, model_output)

    def extract_reasoning(
        self,
        model_output: str,
        request: Any = None,
        prompt_token_ids: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> tuple[str | None, str | None]:
        """Upstream's newer name of `extract_reasoning_content` (same arguments)."""
        return self.extract_reasoning_content(model_output, request, prompt_token_ids,
                                              **kwargs)

    def extract_reasoning_content_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> Any:
        """The DeltaMessage (`reasoning_content` and/or `content`) that `delta_text` adds to a
        streamed reply, or None when it adds nothing visible."""
        from vllm.entrypoints.openai.protocol import DeltaMessage

        old_reasoning, old_content = self.split(self._text_state(previous_text), previous_text)
        reasoning, content = self.split(self._text_state(current_text), current_text)
        new_reasoning = _suffix(reasoning, old_reasoning)
        new_content = _suffix(content, old_content)
        if new_reasoning is None and new_content is None:
            return None
        return DeltaMessage(reasoning=new_reasoning, reasoning_content=new_reasoning,
                            content=new_content)

    def extract_reasoning_streaming(self, *args: Any, **kwargs: Any) -> Any:
        """Upstream's newer name of `extract_reasoning_content_streaming`."""
        return self.extract_reasoning_content_streaming(*args, **kwargs)


def _suffix(text: str | None, before: str | None) -> str | None:
    """What `text` adds after `before` (None when nothing)."""
    if not text:
        return None
    before = before or ""
    if text.startswith(before):
        return text[len(before):] or None
    return text


P = TypeVar("P", bound=type[ReasoningParser])


class ReasoningParserManager:
    """The registry of reasoning parsers by name (what `--reasoning-parser NAME` picks)."""

    reasoning_parsers: dict[str, type[ReasoningParser]] = {}
    # Resolved paths of the plugin files this process has imported.
    _plugins_imported: set[str] = set()

    @classmethod
    def get_reasoning_parser(cls, name: str | None) -> type[ReasoningParser]:
        """The parser class registered as `name`; ValueError naming --reasoning-parser and
        the known names when there is none."""
        parser = cls.reasoning_parsers.get(name) if name is not None else None
        if parser is None:
            raise ValueError(
                f"--reasoning-parser: {name!r} is not one of "
                f"{', '.join(sorted(cls.reasoning_parsers))}"
            )
        return parser

    @classmethod
    def register_module(
        cls,
        name: str | list[str] | None = None,
        force: bool = True,
        module: type[ReasoningParser] | None = None,
    ) -> Any:
        """Registers a ReasoningParser subclass under `name` (or names; default: the class
        name). Used as a decorator, `@ReasoningParserManager.register_module("mine")`, or
        called with `module=`. With force False, a taken name raises KeyError."""

        def register(parser: P) -> P:
            if not (isinstance(parser, type) and issubclass(parser, ReasoningParser)):
                raise TypeError(f"{parser!r} is not a ReasoningParser subclass")
            names = [parser.__name__] if name is None else (
                [name] if isinstance(name, str) else list(name))
            for each in names:
                if not force and each in cls.reasoning_parsers:
                    raise KeyError(f"reasoning parser {each!r} is already registered")
                cls.reasoning_parsers[each] = parser
            if not parser.name:
                parser.name = names[0]
            return parser

        if module is not None:
            return register(module)
        return register

    @classmethod
    def list_registered(cls) -> list[str]:
        """Every registered name, sorted."""
        return sorted(cls.reasoning_parsers)

    @classmethod
    def import_reasoning_parser(cls, plugin_path: str) -> None:
        """Imports the Python file at `plugin_path` so the parsers it registers can be named
        (upstream's plugin hook, `--reasoning-parser-plugin`). A file already imported by
        this process is not run again. Raises ValueError naming the flag when the file is
        missing or raises while it is imported (with that error)."""
        path = Path(plugin_path).expanduser().resolve()
        if str(path) in cls._plugins_imported:
            return
        if not path.is_file():
            raise ValueError(f"--reasoning-parser-plugin: {plugin_path!r} is not a file")
        # A name of its own, so a plugin called json.py cannot replace the json module.
        name = f"vllm_reasoning_plugin_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--reasoning-parser-plugin: {plugin_path!r} is not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # the user's code: any error is a startup error naming it
            del sys.modules[name]
            raise ValueError(
                f"--reasoning-parser-plugin: importing {plugin_path!r} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        cls._plugins_imported.add(str(path))


class _ParserNames(Mapping[str, bool]):
    """Live view of the registry: name -> always_thinks (what the config and flags check)."""

    def __getitem__(self, name: str) -> bool:
        parser = ReasoningParserManager.reasoning_parsers.get(name)
        if parser is None:
            raise KeyError(name)
        return parser.always_thinks

    def __iter__(self) -> Iterator[str]:
        return iter(list(ReasoningParserManager.reasoning_parsers))

    def __len__(self) -> int:
        return len(ReasoningParserManager.reasoning_parsers)


PARSERS: Mapping[str, bool] = _ParserNames()


class ReasoningStream:
    """Splits one streamed reply into reasoning and content deltas.

    Each call gets the reply's next text and token ids and returns what is new in each part;
    the split is recomputed on the whole text, so an end token arriving in any chunk is found.
    """

    def __init__(self, parser: ReasoningParser, state: ReasoningState) -> None:
        self._parser = parser
        self._state = state
        self._sent_reasoning = 0
        self._sent_content = 0
        self._text = ""

    def update(self, text: str, token_ids: Sequence[int]) -> tuple[str | None, str | None]:
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
