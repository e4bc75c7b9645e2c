"""The lm-format-enforcer structured-output backend: character-level parsers (JSON schema,
regex, string choices) walked over a prefix tree of the vocabulary's token texts.

Supported constraints (`StructuredOutputsParams`):

- `json` / `json_object`: lm-format-enforcer's JsonSchemaParser on the normalized schema
  (`normalize_json_schema`, like every backend), restricted to the keywords it enforces
  (`LMFE_SUBSET`): types, `properties`/`required`, `additionalProperties`, `enum`/`const`,
  `anyOf` (and a `oneOf` normalization proved disjoint), one-schema `allOf`, local `$ref`,
  `items`/`minItems`/`maxItems`, `minLength` and JSON-safe `pattern`s. Others (`minimum`,
  `format`, `prefixItems`, `multipleOf`, `maxLength`, ...) are refused with
  UnsupportedConstraintError naming the keyword: the library would ignore them, or get them
  wrong (the differential check found `maxLength` one character short of enforced, numbers
  written as `76.E02`). Numbers, and values that may be numbers, are refused for that
  reason. Objects get
  only their listed properties (an `additionalProperties` other than false beside them is
  refused); arrays without `maxItems` hold at most 20 items (the
  library's cap). Whitespace: none with `disable_any_whitespace`, else runs of at most
  `max_whitespace` (12, the library's cap, when unbounded); unlike the other backends the
  library also allows a run before and after the value (still valid JSON). A request's
  `whitespace_pattern` is refused.
- `regex`: the whole output matches (the `interegular` dialect, Python-like; `\\d` and `\\w`
  are ASCII; a leading `^` and trailing `$` are dropped; lookarounds and backreferences are
  refused). Only narrow regexes are taken: `.`, negated classes, `\\S`/`\\W`/`\\D` and
  classes of more than 512 characters are refused, as every step would walk the whole
  vocabulary through the automaton character by character (measured: minutes per step for
  `.{0,20}` over 150k tokens).
- `choice`: the output is exactly one of the strings.
- `grammar` and `structural_tag` are refused at admission.

Tokens are matched by their text: tokens that are not whole UTF-8 characters (byte pieces of
a character the vocabulary splits) are never allowed, nor are special tokens and ids past
the tokenizer. Building the vocabulary tree takes seconds (`prepare`, once per process that
forks compile workers); each step walks the tree (about a millisecond, more in free text),
so this backend is for compatibility, not speed. Stop tokens are allowed where the parser
may end and terminate the grammar.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from lmformatenforcer import (
    CharacterLevelParser,
    JsonSchemaParser,
    RegexParser,
    StringParser,
    TokenEnforcer,
    TokenEnforcerTokenizerData,
    UnionParser,
)
from lmformatenforcer.characterlevelparser import CharacterLevelParserConfig
from lmformatenforcer.consts import (
    DEFAULT_MAX_CONSECUTIVE_WHITESPACES,
    DEFAULT_MAX_JSON_ARRAY_LENGTH,
)

from vllm.exceptions import GrammarCompileError, UnsupportedConstraintError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.backends.base import (
    StructuredOutputGrammar,
    request_schema,
    whitespace_limit,
)
from vllm.v1.structured_output.backends.byte_backend import VocabBackend
from vllm.v1.structured_output.backends.vocab_bytes import VocabBytes
from vllm.v1.structured_output.schema.grammar_checks import find_lookaround
from vllm.v1.structured_output.schema.regex_dialect import (
    ascii_classes,
    find_backreference,
    strip_anchors,
)
from vllm.v1.structured_output.schema.subset import (
    SchemaSubset,
    check_subset,
    drop_absent_properties,
    is_narrow,
)

logger = logging.getLogger(__name__)

NAME = "lm-format-enforcer"

LMFE_SUBSET = SchemaSubset(
    backend=NAME,
    keywords=frozenset({
        "type", "properties", "required", "additionalProperties", "enum", "const", "anyOf",
        "oneOf", "allOf", "$ref", "items", "minItems", "maxItems", "minLength", "pattern",
        "uniqueItems",
    }),
    formats=frozenset(),
    raw_patterns=True,
    plain_string_literals=True,
    bare_type_lists=True,
    exact_numbers=False,
    empty_limits=False,
    counts_literal_items=False,
)


# Rows kept for prefixes shorter than the accepted tokens (a rollback of up to this many
# tokens reuses them).
_ROWS_BEHIND = 4


def _unsupported(kind: str, what: str) -> UnsupportedConstraintError:
    return UnsupportedConstraintError(
        f"structured_outputs.{kind}", f"{what} (unsupported by {NAME})"
    )


class _Vocab:
    """The library's tokenizer data plus the engine's token classes (shared by grammars)."""

    def __init__(self, pieces: VocabBytes) -> None:
        texts: dict[int, str] = {}
        for idx, piece in pieces.pieces.items():
            try:
                texts[idx] = piece.decode("utf-8")
            except UnicodeDecodeError:
                continue  # a piece of a character: never allowed
        # Every token is marked as starting a word: the library then reads a token's text
        # from this table instead of decoding the whole output again at every step.
        regular = [(idx, text, True) for idx, text in texts.items()]
        self.data = TokenEnforcerTokenizerData(
            regular, self._decode, list(pieces.stop_ids), False, pieces.vocab_size
        )
        # The library's alphabet is the characters that start a token; a string's parser
        # reads any other character as its end (`"` then " ©" left it closed, with no
        # allowed token after: a dead end found by the differential check). Every
        # character of every token is in it.
        self.data.tokenizer_alphabet = "".join(sorted(
            set(self.data.tokenizer_alphabet).union(*texts.values())))
        self._texts = texts
        # Tokens that may not sit inside a JSON string as they are (a control character or
        # a backslash): the library's free-text shortcut allows them there (measured: a raw
        # control character inside a string), so they are masked in that state.
        self.string_unsafe = np.zeros(self.words_for(pieces.vocab_size) * 32, dtype=bool)
        for idx, text in texts.items():
            self.string_unsafe[idx] = "\\" in text or any(ord(c) < 0x20 for c in text)
        # Tokens that close an object or array first: never right after a comma (the library
        # allowed `{"b":null,}`, then nothing: a dead end found by the differential check).
        self.closes_first = np.zeros(self.words_for(pieces.vocab_size) * 32, dtype=bool)
        for idx, text in texts.items():
            self.closes_first[idx] = text.lstrip()[:1] in ("}", "]")
        self.vocab_size = pieces.vocab_size
        self.words = (pieces.vocab_size + 31) // 32
        self.stop_ids = frozenset(pieces.stop_ids)
        self.masked_token_ids = frozenset(
            set(range(pieces.vocab_size)) - texts.keys() - self.stop_ids
        )

    @staticmethod
    def words_for(vocab_size: int) -> int:
        return (vocab_size + 31) // 32

    def _decode(self, tokens: list[int]) -> str:
        return "".join(self._texts.get(t, "") for t in tokens)


def _in_string(text: str) -> bool:
    """Whether JSON text `text` ends inside a string (an odd number of unescaped quotes)."""
    return re.sub(r'\\.', "", text).count('"') % 2 == 1


def _after_comma(text: str) -> bool:
    """Whether JSON text `text` ends with a comma outside any string (whitespace aside)."""
    return text.rstrip().endswith(",") and not _in_string(text)


class LMFormatEnforcerGrammar(StructuredOutputGrammar):
    """One request's TokenEnforcer (which caches the parser state per token prefix)."""

    def __init__(self, enforcer: TokenEnforcer, vocab: _Vocab, json_output: bool = False
                 ) -> None:
        self._enforcer = enforcer
        self._vocab = vocab
        # A JSON constraint stops only where the text is JSON (see _row).
        self._json_output = json_output
        self._tokens: list[int] = []
        self._terminated = False
        # Allowed-token rows by prefix length (dropped on rollback).
        self._rows: dict[int, np.ndarray] = {}

    @property
    def num_processed_tokens(self) -> int:
        return len(self._tokens) + int(self._terminated)

    def _row(self, tokens: list[int]) -> np.ndarray:
        """The allowed next tokens after `tokens` as a boolean row; stops only where the
        parser may end (the library also allows them after an internal error). Nothing is
        allowed when the library fails (the request then fails on its next token)."""
        size = len(tokens)
        mine = tokens == self._tokens[:size]
        row = self._rows.get(size) if mine else None
        if row is not None:
            return row
        row = np.zeros(self._vocab.words * 32, dtype=bool)
        try:
            allowed, state = self._library_allowed(tokens)
            if allowed:
                row[np.fromiter(allowed, dtype=np.int64, count=len(allowed))] = True
            # The library keeps each prefix's list (up to the whole vocabulary in free text:
            # about a megabyte per generated token); the row replaces it.
            state.allowed_tokens = None
            # The library may also think it can end where the text is no JSON at all (a
            # string it read as closed after " »"; found by the differential check).
            row[list(self._vocab.stop_ids)] = state.parser.can_end() and (
                not self._json_output or self._is_json(tokens))
            shortcut = state.parser.shortcut_key()
        except Exception:  # the library's own errors must not reach the engine's step
            # Nothing allowed: whatever is sampled is rejected and only this request fails
            # (an AttributeError of the library's parser was found by the differential check).
            logger.exception("lm-format-enforcer failed after %d tokens", len(tokens))
            row[:] = False
            return row
        text = self._vocab._decode(tokens) if self._json_output else ""
        if (isinstance(shortcut, tuple) and shortcut[:1] == ("json_freetext",)) or (
                self._json_output and _in_string(text)):
            # Also outside its free-text shortcut the library let a raw NUL into a string
            # (then no stop: a dead end found by the differential check).
            row &= ~self._vocab.string_unsafe
        elif self._json_output and _after_comma(text):
            row &= ~self._vocab.closes_first
        if mine:
            self._rows[size] = row
            # Keep the rows around the current position only (drafts look ahead of it).
            for old in [k for k in self._rows if k < len(self._tokens) - _ROWS_BEHIND]:
                del self._rows[old]
        return row

    def _is_json(self, tokens: list[int]) -> bool:
        try:
            json.loads(self._vocab._decode(tokens))
        except ValueError:
            return False
        return True

    def _library_allowed(self, tokens: list[int]) -> tuple[list[int], Any]:
        """The library's allowed ids after `tokens` and its state for that prefix."""
        enforcer = self._enforcer
        key = tuple(tokens)
        state = enforcer.prefix_states.get(key)
        if state is not None and state.allowed_tokens is None:
            # Released by an earlier `_row`: the library recomputes it from the parser (a
            # private method of lm-format-enforcer 0.11).
            enforcer._compute_allowed_tokens(key, state)
            return state.allowed_tokens.allowed_tokens, state
        allowed = enforcer.get_allowed_tokens(tokens).allowed_tokens
        return allowed, enforcer.prefix_states[key]

    def _walk(self, tokens: Sequence[int]) -> tuple[int, bool]:
        """How many of `tokens` are acceptable and whether they end with a stop; no state
        change."""
        prefix = list(self._tokens)
        for i, token in enumerate(tokens):
            if not 0 <= token < self._vocab.vocab_size or not self._row(prefix)[token]:
                return i, False
            if token in self._vocab.stop_ids:
                return i + 1, True
            prefix.append(token)
        return len(tokens), False

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advances by `tokens`; returns False (and logs) at the first rejected token,
        keeping the tokens before it."""
        if self._terminated:
            if tokens:
                logger.error("request %s: token %d after termination", request_id, tokens[0])
            return not tokens
        taken, stopped = self._walk(tokens)
        self._tokens.extend(tokens[: taken - int(stopped)])
        self._terminated = stopped
        if taken == len(tokens):
            return True
        logger.error(
            "request %s: the grammar rejected token %d after %d tokens",
            request_id, tokens[taken], self.num_processed_tokens,
        )
        return False

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """Returns the longest accepted prefix of `tokens`; the state is unchanged."""
        if self._terminated:
            return []
        return list(tokens[: self._walk(tokens)[0]])

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` tokens. Raises ValueError past the start."""
        if not 0 <= num_tokens <= self.num_processed_tokens:
            raise ValueError(
                f"rollback: num_tokens must be in [0, {self.num_processed_tokens}], "
                f"got {num_tokens}"
            )
        if num_tokens and self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            del self._tokens[-num_tokens:]
            for key in [k for k in self._rows if k > len(self._tokens)]:
                del self._rows[key]

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]` (all ones once terminated)."""
        if self._terminated:
            bitmask[row] = -1
            return
        bitmask[row] = np.packbits(self._row(self._tokens), bitorder="little").view(np.int32)

    def is_terminated(self) -> bool:
        return self._terminated


class LMFormatEnforcerBackend(VocabBackend):
    """Compiles JSON schemas, regexes and choices with lm-format-enforcer for one engine.

    Raises ValueError when the tokenizer has no vocabulary, no stop token is in the
    vocabulary, or `max_whitespace` is negative.
    """

    name = NAME
    vocab_view = _Vocab

    def compile_grammar(self, params: StructuredOutputsParams) -> LMFormatEnforcerGrammar:
        """Compiles `params` into a fresh grammar.

        Raises UnsupportedConstraintError naming the field and feature the library cannot
        enforce, GrammarCompileError when the constraint is invalid or accepts no output, and
        InvalidRequestError when an option is malformed.
        """
        kind = params.kind
        config = self._config(params)
        parser = self._parser(params, kind, config)
        enforcer = TokenEnforcer(self.vocab.data, parser)
        # TokenEnforcer replaces the parser's settings with its defaults; put ours back.
        parser.config = config
        grammar = LMFormatEnforcerGrammar(enforcer, self.vocab,
                                          json_output=kind in ("json", "json_object"))
        try:
            grammar._library_allowed([])
        except Exception as e:  # the library raises bare Exception for what it lacks
            raise _unsupported(kind, f"the library failed on it: {str(e)[:200]}") from e
        first = grammar._row([]).copy()
        if kind in ("json", "json_object"):
            first[list(self.vocab.stop_ids)] = False  # an empty output is not JSON
        if not first.any():
            raise GrammarCompileError(
                f"structured_outputs.{kind}", "the constraint accepts no output at all"
            )
        return grammar

    def _config(self, params: StructuredOutputsParams) -> CharacterLevelParserConfig:
        if params.whitespace_pattern is not None:
            raise _unsupported("whitespace_pattern", "a whitespace pattern")
        limit = whitespace_limit(params, self.options)
        return CharacterLevelParserConfig(
            alphabet=self.vocab.data.tokenizer_alphabet,
            max_consecutive_whitespaces=(
                DEFAULT_MAX_CONSECUTIVE_WHITESPACES if limit is None else limit
            ),
            force_json_field_order=False,
            max_json_array_length=DEFAULT_MAX_JSON_ARRAY_LENGTH,
        )

    def _parser(
        self, params: StructuredOutputsParams, kind: str, config: CharacterLevelParserConfig
    ) -> CharacterLevelParser:
        param = f"structured_outputs.{kind}"
        if kind in ("json", "json_object"):
            schema = request_schema(params, kind, self.options)
            drop_absent_properties(schema)
            check_subset(schema, LMFE_SUBSET)
            try:
                return JsonSchemaParser(schema, config=config)
            except Exception as e:  # the library raises bare Exception for what it lacks
                raise _unsupported(kind, str(e).split("\n", 1)[0][:300]) from e
        if kind == "regex":
            regex = params.regex
            opener = find_lookaround(regex) or find_backreference(regex)
            if opener is not None:
                raise _unsupported(kind, f"{opener!r} (lookarounds and backreferences)")
            try:
                re.compile(regex)
            except re.error as e:
                raise GrammarCompileError(param, f"invalid regex: {e}") from e
            if not is_narrow(regex):
                # Each step would walk the whole vocabulary through the regex automaton one
                # character at a time: minutes for `.{0,20}` over 150k tokens.
                raise _unsupported(
                    kind, "a regex with `.`, a negated class, \\S, \\W, \\D or a class of "
                    "more than 512 characters (too slow to enforce character by character)"
                )
            try:
                return RegexParser(ascii_classes(strip_anchors(regex)), config=config)
            except Exception as e:  # interegular's parse errors have no common base
                raise _unsupported(kind, f"the regex cannot be compiled ({str(e)[:200]})") from e
        if kind == "choice":
            return UnionParser([StringParser(c) for c in params.choice])
        if kind in ("grammar", "structural_tag"):
            raise _unsupported(
                kind, f"{kind} constraints cannot be enforced: lm-format-enforcer takes only "
                "regex, json, json_object and choice"
            )
        raise GrammarCompileError("structured_outputs", f"unknown constraint {kind!r}")
