"""The outlines structured-output backend (through `outlines_core`): a constraint becomes a
regular expression, compiled into an index (a DFA whose transitions are the vocabulary's
tokens), and the bitmask of a state is the tokens leaving it.

Supported constraints (`StructuredOutputsParams`):

- `regex`: the whole output matches (Rust `regex` dialect; `\\d` and `\\w` are ASCII as in
  the other backends; a leading `^` and trailing `$` are dropped, other anchors, lookarounds,
  backreferences and word boundaries are refused).
- `choice`: the output is exactly one of the strings.
- `json` / `json_object`: the schema (first `normalize_json_schema`, like every backend) is
  turned into a regex by outlines_core's `build_regex_from_schema`. Only the keywords outlines
  enforces are taken (`OUTLINES_SUBSET`): types, `properties`/`required`, `enum`/`const`,
  `anyOf` (and a `oneOf` normalization proved disjoint), one-schema `allOf`, local `$ref`
  (recursion is unrolled a few levels), `items`/`prefixItems`/`minItems`/`maxItems`,
  `minLength`/`maxLength`, JSON-safe `pattern`s and the format uuid. Anything else (`minimum`, `multipleOf`, `patternProperties`, ...) is refused
  with UnsupportedConstraintError naming the keyword: outlines would ignore it. Objects get
  only their listed properties, in schema order (an `additionalProperties` other than false
  beside them is refused), and arrays with `prefixItems` only their
  listed items (an `items` schema after them is refused; shorter tuples are spelled out as
  tuples of their own, `spell_out_tuples`); a value that may be anything is written as the
  list of every type (`type_open_values`). A number that may have a fraction cannot be
  the whole output (outlines-core 0.2.14 drops the steps from a final state of its index to
  a state that is not, so "2" never continues to "2.5"). Whitespace follows the engine's rules (none
  with `disable_any_whitespace`, runs of at most `max_whitespace`, a request's
  `whitespace_pattern`), never before or after the value.
- `grammar` and `structural_tag` are refused at admission: outlines has no grammars.

The index is built over the whole vocabulary when the constraint compiles (about 0.2 s for a
small schema over 150k tokens; a big one takes seconds): that runs in the compile pool like
every backend's compile, so one over the time limit fails its request, and indexes are
cached per regex. The vocabulary view (`prepare`, about a second) is built once per process
that forks compile workers.

Stop tokens never reach the index: one is accepted where the index is in a final state and
terminates the grammar. Special tokens and ids past the tokenizer are never allowed. Outputs
are valid UTF-8: the index is an automaton over the bytes of UTF-8 text.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import outlines_core as oc
from outlines_core.json_schema import build_regex_from_schema

from vllm.exceptions import GrammarCompileError, UnsupportedConstraintError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.backends.base import (
    BackendOptions,
    StructuredOutputGrammar,
    check_first_step,
    check_whitespace_pattern,
    request_schema,
    whitespace_limit,
)
from vllm.v1.structured_output.backends.byte_backend import VocabBackend
from vllm.v1.structured_output.backends.vocab_bytes import VocabBytes
from vllm.v1.structured_output.schema.grammar_checks import find_lookaround
from vllm.v1.structured_output.schema.regex_dialect import (
    ascii_classes,
    choice_regex,
    find_backreference,
    strip_anchors,
)
from vllm.v1.structured_output.schema.facts import kinds, values
from vllm.v1.structured_output.schema.subset import (
    SchemaSubset,
    check_subset,
    spell_out_tuples,
    type_open_values,
)

logger = logging.getLogger(__name__)

NAME = "outlines"

OUTLINES_SUBSET = SchemaSubset(
    backend=NAME,
    keywords=frozenset({
        "type", "properties", "required", "additionalProperties", "enum", "const", "anyOf",
        "oneOf", "allOf", "$ref", "items", "prefixItems", "minItems", "maxItems",
        "minLength", "maxLength", "pattern", "format", "uniqueItems",
    }),
    # outlines-core 0.2.14's other formats write invalid JSON or values outside the format:
    # `uri` and `email` a raw quote or control character inside the string, `time` a
    # backslash before any character, `date` and `date-time` February 30, `date-time` no
    # offset and five-digit years (found by the differential check and its regexes).
    formats=frozenset({"uuid"}),
    raw_patterns=True,
)

# Indexes kept per backend (a JSON-schema index is a few MB).
_INDEX_CACHE_ENTRIES = 32
# States a grammar's mask writer can step back without replaying from the start.
_MAX_ROLLBACK = 64
# A whitespace run between JSON tokens when nothing bounds it.
_ANY_WHITESPACE = r"[ \t\n\r]*"
_JSON_WHITESPACE = r"[ \t\n\r]"
_NO_TRANSITIONS = re.compile(r"missing tokens corresponding to at least one of the following")


def _unsupported(kind: str, what: str) -> UnsupportedConstraintError:
    return UnsupportedConstraintError(
        f"structured_outputs.{kind}", f"{what} (unsupported by {NAME})"
    )


def _may_continue_a_whole_output(schema: dict[str, Any]) -> bool:
    """Whether a whole output of `schema` may go on past a point where it could also end
    through text that could not end it: a number with a fraction (`2` to `2.5`), or listed
    values one of which starts another (`1` and `1.5`)."""
    listed = values(schema, schema)
    if listed is None:
        return "fraction" in kinds(schema, schema)
    return any(a != b and b.startswith(a) for a in listed for b in listed)


class _Vocab:
    """The outlines view of one vocabulary and the stop-token bits (shared by grammars)."""

    def __init__(self, pieces: VocabBytes) -> None:
        by_bytes: dict[bytes, list[int]] = {}
        for idx, piece in pieces.pieces.items():
            by_bytes.setdefault(piece, []).append(idx)
        # outlines keeps one EOS id outside the token map; the backend handles every stop id.
        self.index_vocab = oc.Vocabulary(pieces.stop_ids[0], by_bytes)
        self.vocab_size = pieces.vocab_size
        self.words = (pieces.vocab_size + 31) // 32
        self.stop_ids = frozenset(pieces.stop_ids)
        self.masked_token_ids = pieces.masked_token_ids
        stop_row = np.zeros(self.words * 32, dtype=bool)
        stop_row[list(self.stop_ids)] = True
        packed = np.packbits(stop_row, bitorder="little").view(np.int32)
        self.stop_words = np.flatnonzero(packed)
        self.stop_bits = packed[self.stop_words]


class OutlinesGrammar(StructuredOutputGrammar):
    """One request's position in an outlines index.

    `_states[i]` is the index state after i accepted ordinary tokens; the outlines Guide is
    kept at the last state only to write masks (it can write them natively).
    """

    def __init__(self, index: oc.Index, vocab: _Vocab) -> None:
        self._index = index
        self._vocab = vocab
        self._states = [index.get_initial_state()]
        self._tokens: list[int] = []
        self._terminated = False
        self._guide = oc.Guide(index, max_rollback=_MAX_ROLLBACK)

    @property
    def num_processed_tokens(self) -> int:
        return len(self._tokens) + int(self._terminated)

    def _next(self, state: int, token: int) -> int | None:
        """The state after `token`, or None when the index refuses it (or it is a stop)."""
        if token in self._vocab.stop_ids or not 0 <= token < self._vocab.vocab_size:
            return None
        return self._index.get_next_state(state, token)

    def _walk(self, tokens: Sequence[int]) -> tuple[list[int], bool]:
        """The states after the longest acceptable prefix of `tokens` and whether that prefix
        ends with a stop token; no state change."""
        states: list[int] = []
        state = self._states[-1]
        for token in tokens:
            if token in self._vocab.stop_ids:
                return states, self._index.is_final_state(state)
            nxt = self._next(state, token)
            if nxt is None:
                break
            states.append(nxt)
            state = nxt
        return states, False

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advances by `tokens`; returns False (and logs) at the first rejected token,
        keeping the tokens before it."""
        if self._terminated:
            if tokens:
                logger.error("request %s: token %d after termination", request_id, tokens[0])
            return not tokens
        states, stopped = self._walk(tokens)
        taken = len(states)
        for state, token in zip(states, tokens):
            self._states.append(state)
            self._tokens.append(token)
            self._guide.advance(token, return_tokens=False)
        if stopped:
            self._terminated = True
            taken += 1
        if taken == len(tokens):
            return True
        logger.error(
            "request %s: the grammar rejected token %d after %d tokens%s",
            request_id, tokens[taken], self.num_processed_tokens,
            " (already terminated)" if self._terminated else "",
        )
        return False

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """Returns the longest accepted prefix of `tokens` (ending at the first stop token it
        accepts); the state is unchanged."""
        if self._terminated:
            return []
        states, stopped = self._walk(tokens)
        return list(tokens[: len(states) + int(stopped)])

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
        if not num_tokens:
            return
        del self._states[-num_tokens:]
        del self._tokens[-num_tokens:]
        if num_tokens <= self._guide.get_allowed_rollback():
            self._guide.rollback_state(num_tokens)
        else:  # deeper than the guide remembers: replay (drafts never go this far)
            self._guide.reset()
            for token in self._tokens:
                self._guide.advance(token, return_tokens=False)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]` (all ones once terminated)."""
        if self._terminated:
            bitmask[row] = -1
            return
        target = bitmask[row]
        if not target.flags.c_contiguous:
            raise ValueError("fill_bitmask: bitmask rows must be C-contiguous")
        self._guide.write_mask_into(target.ctypes.data, target.size, 4)
        vocab = self._vocab
        # The guide allows its one EOS id in final states; every stop id is allowed there.
        if self._index.is_final_state(self._states[-1]):
            target[vocab.stop_words] |= vocab.stop_bits
        else:
            target[vocab.stop_words] &= ~vocab.stop_bits

    def is_terminated(self) -> bool:
        return self._terminated


class OutlinesBackend(VocabBackend):
    """Compiles regexes, choices and JSON schemas with outlines_core for one engine.

    Thread-safe. Raises ValueError when the tokenizer has no vocabulary, no stop token is in
    the vocabulary, or `max_whitespace` is negative.
    """

    name = NAME
    vocab_view = _Vocab

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        options: BackendOptions = BackendOptions(),
        prepared: _Vocab | None = None,
    ) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids, options, prepared)
        self._indexes: OrderedDict[str, oc.Index] = OrderedDict()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ compiling

    def compile_grammar(self, params: StructuredOutputsParams) -> OutlinesGrammar:
        """Compiles `params` into a fresh grammar.

        Raises UnsupportedConstraintError naming the field and feature outlines cannot enforce
        (grammars, structural tags, some schema keywords and regex features),
        GrammarCompileError when the constraint is invalid or accepts no output, and
        InvalidRequestError when an option is malformed.
        """
        kind = params.kind
        regex = self._regex(params, kind)
        grammar = OutlinesGrammar(self._index(regex, kind, params), self.vocab)
        check_first_step(grammar, self.vocab.words, self.vocab.stop_words,
                         self.vocab.stop_bits, kind)
        return grammar

    def _regex(self, params: StructuredOutputsParams, kind: str) -> str:
        if kind == "regex":
            return ascii_classes(strip_anchors(params.regex))
        if kind == "choice":
            return choice_regex(params.choice)
        if kind in ("json", "json_object"):
            return ascii_classes(self._json_regex(params, kind))
        if kind in ("grammar", "structural_tag"):
            raise _unsupported(
                kind, f"{kind} constraints cannot be enforced: outlines takes only regex, "
                "json, json_object and choice"
            )
        raise GrammarCompileError("structured_outputs", f"unknown constraint {kind!r}")

    def _json_regex(self, params: StructuredOutputsParams, kind: str) -> str:
        schema = request_schema(params, kind, self.options)
        if _may_continue_a_whole_output(schema):
            # outlines-core 0.2.14 drops an index's steps from a final state to one that is
            # not ("2" to "2."), so a number as the whole output never gets its fraction or
            # exponent (found by the differential check); inside a container it does.
            raise _unsupported(kind, "a number that may have a fraction as the whole output")
        spell_out_tuples(schema)
        type_open_values(schema)
        check_subset(schema, OUTLINES_SUBSET)
        whitespace = self._whitespace(params)  # its InvalidRequestError names its own field
        try:
            return build_regex_from_schema(json.dumps(schema), whitespace)
        except (ValueError, TypeError) as e:
            message = str(e).split("\n", 1)[0].strip()[:300]
            raise _unsupported(kind, message) from e

    def _whitespace(self, params: StructuredOutputsParams) -> str:
        """The regex of one whitespace place between JSON tokens."""
        if self.options.disable_any_whitespace or params.disable_any_whitespace:
            return ""
        if params.whitespace_pattern is not None:
            check_whitespace_pattern(params.whitespace_pattern)
            return f"(?:{params.whitespace_pattern})?"
        limit = whitespace_limit(params, self.options)
        if limit is None:
            return _ANY_WHITESPACE
        return f"{_JSON_WHITESPACE}{{0,{limit}}}"

    def _index(self, regex: str, kind: str, params: StructuredOutputsParams) -> oc.Index:
        """The index of `regex`, built now (seconds for big ones) or from the cache."""
        with self._lock:
            index = self._indexes.get(regex)
            if index is not None:
                self._indexes.move_to_end(regex)
                return index
        try:
            # Releases the GIL while it builds: other threads keep running.
            index = oc.Index(regex, self.vocab.index_vocab)
        except ValueError as e:
            raise self._index_error(kind, params, str(e)) from e
        with self._lock:
            self._indexes[regex] = index
            while len(self._indexes) > _INDEX_CACHE_ENTRIES:
                self._indexes.popitem(last=False)
        return index

    @staticmethod
    def _index_error(
        kind: str, params: StructuredOutputsParams, message: str
    ) -> GrammarCompileError:
        """Tells an invalid regex from one outlines cannot enforce (its errors do not)."""
        param = f"structured_outputs.{kind}"
        if _NO_TRANSITIONS.search(message):
            return GrammarCompileError(param, "no sequence of tokens can write this constraint")
        if kind == "regex":
            regex = params.regex
            opener = find_lookaround(regex)
            if opener is not None:
                return _unsupported(kind, f"lookaround {opener!r}")
            backreference = find_backreference(regex)
            if backreference is not None:
                return _unsupported(kind, f"backreference {backreference!r}")
            try:
                re.compile(regex)
            except re.error as e:
                return GrammarCompileError(param, f"invalid regex: {e}")
        first = message.split("\n", 1)[0].split(":", 1)[-1].strip()
        return _unsupported(kind, f"the regex cannot be compiled ({first[:200]})")


    def destroy(self) -> None:
        """Drops the index cache; grammars already compiled keep working."""
        with self._lock:
            self._indexes.clear()
