"""The two interfaces a structured-output backend implements (one per engine, one per request),
and what every backend takes from the engine: its options and the tokenizer's vocabulary."""

from __future__ import annotations

import json
import re
import re._parser as sre_parse
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm.exceptions import GrammarCompileError, InvalidRequestError
from vllm.sampling_params import StructuredOutputsParams
from vllm.thread_policy import helper_threads
from vllm.v1.structured_output.schema.normalize import normalize_json_schema
from vllm.v1.structured_output.schema.regex_tree import plain_children


@dataclass(frozen=True)
class BackendOptions:
    """The engine-wide settings every backend applies to the constraints it compiles."""

    # Compact JSON (no whitespace between tokens) for every request.
    disable_any_whitespace: bool = False
    # Most whitespace characters in one run between JSON tokens when a request sets no
    # max_whitespace of its own; None: unbounded.
    max_whitespace: int | None = None
    # Enforce a oneOf whose branches may overlap as anyOf instead of refusing it.
    one_of_as_any_of: bool = False
    # Helper threads for compiling and filling bitmasks; None: helper_threads().
    max_threads: int | None = None

    def threads(self) -> int:
        """How many helper threads a backend may use."""
        return self.max_threads if self.max_threads is not None else helper_threads()


@dataclass(frozen=True)
class BackendSetup:
    """What building a backend takes (StructuredOutputBackend.create)."""

    tokenizer: Any
    vocab_size: int
    stop_token_ids: Sequence[int]
    options: BackendOptions = BackendOptions()
    # What the backend's `prepare` returned in the process that forked this one, if any.
    prepared: Any = None
    # Bound of a compiled-grammar cache in bytes; None: the backend's default.
    cache_limit_bytes: int | None = None


def tokenizer_vocab(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's token-to-id map; ValueError when the tokenizer has none."""
    try:
        return tokenizer.get_vocab()
    except AttributeError as e:
        raise ValueError(
            f"structured outputs: tokenizer {type(tokenizer)} has no vocabulary"
        ) from e


# The four characters JSON allows between tokens, as code points of a regex parse.
_JSON_WHITESPACE = frozenset(b" \n\r\t")


def request_schema(params: StructuredOutputsParams, kind: str,
                   options: BackendOptions) -> dict[str, Any]:
    """The normalized JSON schema of a `json` or `json_object` constraint, as a dict (`true`
    becomes `{}`). Raises GrammarCompileError naming the field for the schema `false`, and
    whatever `normalize_json_schema` raises for a schema it refuses."""
    if kind == "json_object":
        # OpenAI's json_object means an object, never a top-level array or scalar.
        return {"type": "object"}
    schema: Any = params.json if isinstance(params.json, dict) else json.loads(params.json)
    schema = normalize_json_schema(
        schema,
        disable_additional_properties=params.disable_additional_properties,
        one_of_as_any_of=options.one_of_as_any_of,
    )
    if schema is True:
        return {}
    if not isinstance(schema, dict):
        raise GrammarCompileError(f"structured_outputs.{kind}", "the schema `false` accepts no value")
    return schema


def whitespace_limit(params: StructuredOutputsParams, options: BackendOptions) -> int | None:
    """The most whitespace characters a request allows in one run between JSON tokens: 0 when
    whitespace is off (per request or engine-wide), None when unbounded. Raises
    InvalidRequestError naming `structured_outputs.max_whitespace` unless it is an integer
    >= 0."""
    if options.disable_any_whitespace or params.disable_any_whitespace:
        return 0
    limit = params.max_whitespace
    if limit is None:
        limit = options.max_whitespace
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise InvalidRequestError(
            "structured_outputs.max_whitespace", f"must be an integer >= 0, got {limit!r}"
        )
    return limit


def check_whitespace_pattern(pattern: str) -> None:
    """Raises InvalidRequestError unless every string `pattern` matches is JSON whitespace.

    Checked on Python's parse of the regex: literals, classes of the four JSON whitespace
    characters, groups, alternations and repeats are allowed; anything else (`\\s`, which
    also matches \\f and \\v, `.`, negated classes, anchors) is refused, since the pattern is
    inserted between JSON tokens and anything else would produce invalid JSON.
    """
    param = "structured_outputs.whitespace_pattern"
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as e:
        raise InvalidRequestError(param, f"invalid regex: {e}") from e

    def ok(items: Any) -> bool:
        for op, arg in items:
            name = str(op)
            if name == "LITERAL":
                if arg not in _JSON_WHITESPACE:
                    return False
            elif name == "IN":
                for member_op, member in arg:
                    member_name = str(member_op)
                    if member_name == "LITERAL" and member in _JSON_WHITESPACE:
                        continue
                    if member_name == "RANGE" and all(
                        c in _JSON_WHITESPACE for c in range(member[0], member[1] + 1)
                    ):
                        continue
                    return False
            else:
                parts = plain_children(op, arg)
                if parts is None or not all(ok(part) for part in parts):
                    return False
        return True

    if not ok(parsed):
        raise InvalidRequestError(
            param, "may only match JSON whitespace (space, \\n, \\r, \\t)"
        )


class StructuredOutputGrammar(ABC):
    """The matcher state of one request's constraint.

    Bitmask rows are int32 words; bit j of word w allows token 32 * w + j. The engine uses
    accept_tokens, fill_bitmask and is_terminated. validate_tokens, rollback,
    jump_forward_tokens, forced_string and num_processed_tokens are for speculative
    decoding: truncating drafts at the first token the grammar rejects, filling one bitmask
    row per draft position by advancing through the drafts and rolling back, and drafting
    what the grammar forces.
    """

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advances the state by `tokens` in order.

        Returns False at the first token the grammar rejects (or any token after termination);
        the tokens before it stay accepted and the rejected one leaves the state unchanged.
        """

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """Returns the longest prefix of `tokens` the grammar would accept; no state change."""

    def jump_forward_tokens(self) -> list[int]:
        """Tokens the grammar forces next, as far as they are certain (jump-forward), in
        the backend's tokenization; [] when the next token is a choice. No state change.

        Canonical fast-forward falls back on them when the grammar refuses the engine
        tokenizer's first token of the forced text.
        """
        return []

    def forced_string(self) -> str:
        """The text the grammar forces next, whole UTF-8 characters only ("" when the next
        character is a choice, or the backend cannot tell). No state change.

        Canonical fast-forward tokenizes it with the engine's tokenizer, so its tokens are
        checked with validate_tokens before they are used.
        """
        return ""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens.

        Raises ValueError if `num_tokens` is negative or more than were accepted.
        """

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]` (all allowed once terminated)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar has accepted a stop token: nothing more may follow."""

    @property
    @abstractmethod
    def num_processed_tokens(self) -> int:
        """How many tokens the grammar has accepted (and not rolled back)."""


def check_first_step(
    grammar: StructuredOutputGrammar,
    words: int,
    stop_words: np.ndarray,
    stop_bits: np.ndarray,
    kind: str,
) -> None:
    """Raises GrammarCompileError when a fresh `grammar` allows no first token, or (JSON)
    only a stop token: an empty output. `words` is the bitmask's row width; the stop tokens
    sit at bits `stop_bits` of words `stop_words`."""
    row = np.zeros((1, words), dtype=np.int32)
    grammar.fill_bitmask(row, 0)
    if not row.any():
        raise GrammarCompileError(
            f"structured_outputs.{kind}", "the constraint accepts no output at all"
        )
    if kind in ("json", "json_object"):
        row[0, stop_words] &= ~stop_bits
        if not row.any():
            raise GrammarCompileError(
                f"structured_outputs.{kind}",
                "the schema accepts only an empty output, which is not JSON",
            )


class StructuredOutputBackend(ABC):
    """Compiles constraints for one engine (one tokenizer, one vocabulary)."""

    #: Rows of a bitmask hold ceil(vocab_size / 32) words.
    vocab_size: int

    @classmethod
    def prepare(cls, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
        """Work worth doing once in a process that forks compile workers (the vocabulary
        view); the result reaches `create` as `setup.prepared` in each worker. None by default."""
        return None

    @classmethod
    def create(cls, setup: BackendSetup) -> StructuredOutputBackend:
        """Builds the backend for one engine from `setup` (backends without a cache or a
        `prepare` ignore those fields). Raises RuntimeError when the tokenizer is missing."""
        if setup.tokenizer is None:
            raise RuntimeError(f"structured outputs: {cls.__name__} needs the tokenizer")
        return cls(  # type: ignore[call-arg]
            setup.tokenizer, setup.vocab_size, setup.stop_token_ids, setup.options
        )

    @abstractmethod
    def compile_grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """Compiles `params` into a fresh grammar in its initial state.

        Raises ValueError naming the field when the schema, regex, grammar, choice or
        structural tag is invalid or uses a feature the backend cannot enforce.
        """

    def allocate_token_bitmask(self, max_num_seqs: int) -> np.ndarray:
        """Returns an int32 bitmask of `max_num_seqs` rows, every token allowed."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be at least 1, got {max_num_seqs}")
        return np.full((max_num_seqs, (self.vocab_size + 31) // 32), -1, dtype=np.int32)

    def fill_bitmasks(
        self,
        grammars: Sequence[StructuredOutputGrammar],
        bitmask: np.ndarray,
        rows: Sequence[int],
    ) -> None:
        """Fills `bitmask[rows[i]]` from `grammars[i]` for every i (a terminated grammar's row
        allows every token); other rows are left as they are.

        Every grammar must come from this backend. Backends fill the rows of grammars still
        running in `fill_unterminated`.
        """
        live: list[StructuredOutputGrammar] = []
        live_rows: list[int] = []
        for grammar, row in zip(grammars, rows, strict=True):
            if grammar.is_terminated():
                bitmask[row] = -1
            else:
                live.append(grammar)
                live_rows.append(int(row))
        if live:
            self.fill_unterminated(live, bitmask, live_rows)

    def fill_unterminated(
        self, grammars: list[StructuredOutputGrammar], bitmask: np.ndarray, rows: list[int]
    ) -> None:
        """Fills `bitmask[rows[i]]` from `grammars[i]`, none of them terminated, row by row.
        Backends override this to fill the whole batch in one native call."""
        for grammar, row in zip(grammars, rows):
            grammar.fill_bitmask(bitmask, row)

    def destroy(self) -> None:
        """Releases the backend's resources (caches, threads). It is unusable afterwards."""
