"""The llguidance structured-output backend: compiles constraints into token-bitmask matchers.

Supported constraints (`StructuredOutputsParams`):

- `json`: a JSON schema (dict or string), first normalized by `normalize_json_schema` (the
  backend-neutral copy: draft semantics made explicit, provably disjoint `oneOf` as `anyOf`,
  `disable_additional_properties` applied), then compiled by llguidance, which follows JSON
  Schema: unlike xgrammar's strict mode, an object schema that does not forbid additional
  properties lets the model add properties of its own. Whitespace between JSON tokens: none
  with `disable_any_whitespace` (per request or engine-wide); else the request's
  `whitespace_pattern` (each place holds nothing or one match of it; it may only match the
  four JSON whitespace characters); else runs of at most `max_whitespace` characters (per
  request, else engine-wide; None: unbounded). Never before or after the value. A top-level
  `x-guidance` key (llguidance's options) is ignored: a schema cannot switch enforcement
  off (`lenient`) or change the separators.
- `json_object`: any JSON object (schema `{"type": "object"}`, same whitespace rules).
- `regex`: the whole output matches the regex (Rust `regex` dialect: no lookarounds,
  backreferences or word boundaries; `\\d` and `\\w` are ASCII, as in xgrammar).
- `choice`: the output is exactly one of the strings.
- `grammar`: a Lark grammar with a `start` rule when the text has no `::=`; otherwise EBNF/GBNF
  (`root ::= ...`), converted to Lark by llguidance's `gbnf_to_lark`.
- `structural_tag`: written as Lark by `structural_tag_lark.py` (free text with lazy
  triggers, tags whose JSON schemas are normalized and bounded like `json` constraints;
  added tokens such as `<tool_call>` match as the token or as text).

Refused with UnsupportedConstraintError (another backend may enforce them; the message names
the feature): JSON-schema keywords llguidance does not implement (`not`, `if`/`then`/`else`,
`contains`, `propertyNames`, `uniqueItems` that normalization cannot turn into `maxItems: 1`,
`dependentRequired`, `unevaluatedProperties`, ...), formats it does not know, `oneOf` that
normalization leaves (`one_of_as_any_of` enforces it as `anyOf`), `minProperties`/
`maxProperties` beside optional properties, lookarounds and backreferences, EBNF that
llguidance cannot convert or compile, Lark grammars using llguidance-only features that
would break the engine's guarantees (token-id references `<[...]>`, `%llguidance` options,
`stop=`/`max_tokens=` rule attributes, which make rollback impossible), and structural-tag
formats other than those above (`any_text`, `tags_with_separator`, `grammar`, the `qwen_xml`
JSON style). Invalid input (bad regex or grammar syntax, an invalid or unsatisfiable
schema) raises GrammarCompileError naming the field.

Tokens the model may never write inside a constraint (the tokenizer's special tokens other
than the stop ids, and ids past the tokenizer's vocabulary) are masked and
rejected. llguidance never allows them unless a Lark grammar names one (`<|im_start|>`); the
backend does not rely on that. Outputs are valid UTF-8: llguidance matches bytes against
automata over Unicode scalar values.

Stop tokens never reach llguidance: one is accepted when the matcher is in an accepting
state, and it terminates the grammar (xgrammar's semantics). llguidance's own EOS handling
differs by state (once no byte can follow, `try_consume_tokens` refuses EOS although the mask
allows it; in a dead end it allows EOS in the mask, and consuming it enters the matcher's
unrecoverable error state). Ordinary tokens go through `try_consume_tokens`, which stops
before a rejected token without entering that state.

Constraints that no output can satisfy are rejected with a GrammarCompileError: llguidance
and `normalize_json_schema` report unsatisfiable schemas; grammar rules that can never finish
are found by `check_grammar_text`; and any compiled constraint whose first step allows no
token (for JSON: only a stop token) is refused.

Known limits: keys matched by `additionalProperties`/`patternProperties` may repeat (llguidance
enforces unique keys only for `properties`); properties follow schema order; strings never
use `\\uXXXX` escapes for printable characters; llguidance's parser limits (Earley items and
lexer fuel per step) can stop a pathological grammar mid-output, after which every token is
rejected and the request fails.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import llguidance as llg
import llguidance.hf
import llguidance.numpy as llg_numpy
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from vllm.exceptions import (
    GrammarCompileError,
    UnsupportedConstraintError,
)
from vllm.sampling_params import StructuredOutputsParams
from vllm.transformers_utils.tokenizer import control_token_ids
from vllm.v1.structured_output.backends.base import (
    BackendOptions,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    check_first_step,
    check_whitespace_pattern,
    tokenizer_vocab,
    whitespace_limit,
)
from vllm.v1.structured_output.backends.guidance_checks import (
    check_lark,
    clean_error,
    compile_error,
    first_line,
    refuse_escape_blind_patterns,
    refuse_fractions,
    refuse_open_bound,
)
from vllm.v1.structured_output.backends.structural_tag_lark import LarkWriter, parse_structural_tag
from vllm.v1.structured_output.schema.for_xgrammar import GUIDANCE_FORMATS, XGRAMMAR_FORMATS
from vllm.v1.structured_output.schema.grammar_checks import check_grammar_text
from vllm.v1.structured_output.schema.lengths import spell_formats
from vllm.v1.structured_output.schema.normalize import (
    normalize_json_schema,
    spell_out_min_properties,
)

logger = logging.getLogger(__name__)

# Batches at least this large fill their bitmasks on several threads (as in the xgrammar
# backend: waking helper threads costs more than it saves for small batches).
_PARALLEL_FILL_MIN = 64


def choice_to_lark(choices: Sequence[str]) -> str:
    """Returns a Lark grammar whose language is exactly the strings in `choices`."""
    # JSON string escapes (\", \\, \n, \uXXXX) are valid Lark string-literal escapes, and a
    # literal is matched as text, so regex or Lark metacharacters need no escaping.
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# Formats llguidance does not know; those with a class of valid characters become a pattern.
_MISSING_FORMATS = XGRAMMAR_FORMATS - GUIDANCE_FORMATS


class _Vocab:
    """What grammars of one backend share: the token classes and the mask fixes."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        vocab = tokenizer_vocab(tokenizer)
        stops = sorted({int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size})
        try:
            # An empty list means "the tokenizer's EOS" (llguidance refuses an empty list).
            self.tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=vocab_size, eos_token=stops or None
            )
        except ValueError as e:
            raise ValueError(f"structured outputs (llguidance): {e}") from e
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.stop_ids: frozenset[int] = frozenset(self.tokenizer.eos_tokens)
        # Added tokens that are text (`<tool_call>`): llguidance reads them as special, so a
        # structural tag names them by id (structural_tag_lark).
        added = getattr(tokenizer, "get_added_vocab", lambda: {})()
        # Ordinary tokens: in the vocabulary and not special (the xgrammar backend's rule).
        control = control_token_ids(tokenizer)
        allowed = np.zeros(self.words * 32, dtype=bool)
        for idx in vocab.values():
            if 0 <= idx < vocab_size and idx not in control:
                allowed[idx] = True
        self.ordinary = allowed[:vocab_size].copy()
        self.added_tokens: dict[str, int] = {
            text: idx for text, idx in added.items()
            if 0 <= idx < vocab_size and self.ordinary[idx] and idx not in self.stop_ids
        }
        for idx in self.stop_ids:
            allowed[idx] = True
        keep = np.packbits(allowed, bitorder="little").view(np.int32)
        # Only the words holding a forbidden id need fixing (10 of 4748 for Qwen).
        self.fix_words = np.flatnonzero(keep != -1)
        self.fix_keep = keep[self.fix_words]
        # One entry per word (several stop ids may share one: Qwen's 151643 and 151645), as
        # `row[words] &= bits` with a repeated word would apply only one of them.
        by_word: dict[int, int] = {}
        for token in self.stop_ids:
            by_word[token // 32] = by_word.get(token // 32, 0) | (1 << (token % 32))
        self.stop_words = np.array(sorted(by_word), dtype=np.int64)
        self.stop_bits = (
            np.array([by_word[w] for w in sorted(by_word)], dtype=np.int64)
            .astype(np.uint32)
            .view(np.int32)
        )

    def masked_token_ids(self) -> frozenset[int]:
        """Ids never allowed inside a constraint."""
        return frozenset(
            int(i) for i in np.flatnonzero(~self.ordinary) if int(i) not in self.stop_ids
        )

    def is_ordinary(self, token: int) -> bool:
        return 0 <= token < self.vocab_size and bool(self.ordinary[token])


def _whole_characters(data: bytes) -> str:
    """The longest prefix of `data` that is whole UTF-8 characters, as text ("" when `data`
    starts with a continuation byte or is not UTF-8 at all)."""
    if data[:1] and 0x80 <= data[0] < 0xC0:
        return ""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        # An incomplete last character is cut; an invalid one earlier cuts there too.
        return data[: e.start].decode("utf-8")


class GuidanceGrammar(StructuredOutputGrammar):
    """One request's llguidance matcher plus the bookkeeping the scheduler needs.

    Only ordinary tokens reach the matcher; a stop token is handled here (see the module
    docstring), so `num_processed_tokens` is the matcher's count plus one once terminated.
    """

    def __init__(self, matcher: llg.LLMatcher, vocab: _Vocab) -> None:
        self.matcher = matcher
        self._vocab = vocab
        self._consumed = 0  # tokens the matcher holds
        self._terminated = False

    @property
    def num_processed_tokens(self) -> int:
        return self._consumed + int(self._terminated)

    def _advance(self, tokens: Sequence[int]) -> int:
        """Consumes the longest acceptable prefix of `tokens`; returns its length.

        A rejected token leaves the matcher as it was: ordinary tokens go through
        try_consume_tokens, which stops before a token the grammar rejects, and stop tokens
        and forbidden ids never reach the matcher.
        """
        done = 0
        while done < len(tokens) and not self._terminated:
            token = tokens[done]
            if token in self._vocab.stop_ids:
                if not self.matcher.is_accepting():
                    break
                self._terminated = True
                done += 1
                break
            end = done
            while (
                end < len(tokens)
                and tokens[end] not in self._vocab.stop_ids
                and self._vocab.is_ordinary(tokens[end])
            ):
                end += 1
            if end == done:
                break  # a forbidden id
            taken = self.matcher.try_consume_tokens(list(tokens[done:end]))
            self._consumed += taken
            done += taken
            if done < end:
                break
        return done

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advances by `tokens`; returns False (and logs) at the first rejected token, keeping
        the tokens before it."""
        was_terminated = self._terminated
        done = self._advance(tokens)
        if done == len(tokens):
            return True
        logger.error(
            "request %s: the grammar rejected token %d after %d tokens%s%s",
            request_id,
            tokens[done],
            self.num_processed_tokens,
            " (already terminated)" if self._terminated or was_terminated else "",
            f" ({self.matcher.get_error()[:200]})" if self.matcher.is_error() else "",
        )
        return False

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """Returns the longest accepted prefix of `tokens` (ending at the first stop token it
        accepts); the state is unchanged."""
        if self._terminated:
            return []
        before = self._consumed
        done = self._advance(tokens)
        self._undo(self.num_processed_tokens - before)
        return list(tokens[:done])

    def _undo(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            if not self.matcher.rollback(num_tokens):
                raise RuntimeError(
                    f"llguidance could not roll back {num_tokens} tokens: "
                    f"{first_line(self.matcher.get_error())[:200]}"
                )
            self._consumed -= num_tokens

    def jump_forward_tokens(self) -> list[int]:
        """llguidance's forced tokens (`compute_ff_tokens`), cut where this grammar's own
        checks would refuse them."""
        if self._terminated:
            return []
        return self.validate_tokens(list(self.matcher.compute_ff_tokens()))

    def forced_string(self) -> str:
        """llguidance's forced bytes (`compute_ff_bytes`) as text: cut before an incomplete
        last character, and "" when they start inside one (after a token that split it)."""
        if self._terminated:
            return ""
        return _whole_characters(bytes(self.matcher.compute_ff_bytes()))

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` tokens. Raises ValueError past the start."""
        if not 0 <= num_tokens <= self.num_processed_tokens:
            raise ValueError(
                f"rollback: num_tokens must be in [0, {self.num_processed_tokens}], "
                f"got {num_tokens}"
            )
        self._undo(num_tokens)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]` (all ones once terminated)."""
        if self._terminated:
            bitmask[row] = -1
            return
        llg_numpy.fill_next_token_bitmask(self.matcher, bitmask, row)
        self.fix_row(bitmask, row)

    def fix_row(self, bitmask: np.ndarray, row: int) -> None:
        """Clears forbidden ids from `bitmask[row]`, and the stop tokens unless the matcher
        is accepting (llguidance allows them in dead ends too, where accept_tokens would
        refuse them)."""
        vocab = self._vocab
        bitmask[row, vocab.fix_words] &= vocab.fix_keep
        if (bitmask[row, vocab.stop_words] & vocab.stop_bits).any() and not (
            self.matcher.is_accepting()
        ):
            bitmask[row, vocab.stop_words] &= ~vocab.stop_bits

    def is_terminated(self) -> bool:
        return self._terminated


class GuidanceBackend(StructuredOutputBackend):
    """Compiles constraints with llguidance for one engine.

    Building it costs about three seconds (llguidance's view of the vocabulary). Raises
    ValueError when the tokenizer is not a fast Hugging Face tokenizer or has no vocabulary,
    or when `max_whitespace` is negative.
    """

    name = "guidance"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        options: BackendOptions = BackendOptions(),
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size: must be positive, got {vocab_size}")
        max_whitespace = options.max_whitespace
        if max_whitespace is not None and max_whitespace < 0:
            raise ValueError(f"max_whitespace: must be >= 0 or None, got {max_whitespace}")
        self.vocab_size = vocab_size
        self.options = options
        self.vocab = _Vocab(tokenizer, vocab_size, stop_token_ids)
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(self.vocab.stop_ids))
        self.masked_token_ids = self.vocab.masked_token_ids()
        self._threads = options.threads()
        self._executor: llg.LLExecutor | None = None
        self._executor_pid = -1
        self._destroyed = False

    # ------------------------------------------------------------------ compiling

    def compile_grammar(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        """Compiles `params` into a fresh matcher.

        Raises UnsupportedConstraintError naming the field and feature when llguidance cannot
        enforce the constraint, GrammarCompileError when it is invalid or no output can
        satisfy it, and InvalidRequestError when an option is malformed.
        """
        kind = params.kind
        grammar_text = self._grammar_text(params, kind)
        # log_level=0: llguidance would print a warning to stderr for every rejected token.
        matcher = llg.LLMatcher(self.vocab.tokenizer, grammar_text, log_level=0)
        if matcher.is_error():
            if kind == "grammar" and "::=" in params.grammar:
                # The text is in xgrammar's EBNF dialect; llguidance's conversion may not
                # understand all of it, so another backend may still compile it.
                raise UnsupportedConstraintError(
                    "structured_outputs.grammar",
                    f"{clean_error(matcher.get_error())[:300]} "
                    "(llguidance could not compile this EBNF)",
                )
            raise compile_error(kind, matcher.get_error())
        grammar = GuidanceGrammar(matcher, self.vocab)
        check_first_step(grammar, self.vocab.words, self.vocab.stop_words,
                         self.vocab.stop_bits, kind)
        return grammar

    def _grammar_text(self, params: StructuredOutputsParams, kind: str) -> str:
        if kind in ("json", "json_object"):
            if kind == "json":
                schema = params.json if isinstance(params.json, dict) else json.loads(params.json)
                schema = normalize_json_schema(
                    schema,
                    disable_additional_properties=params.disable_additional_properties,
                    one_of_as_any_of=self.options.one_of_as_any_of,
                )
                spell_out_min_properties(schema)
                spell_formats(schema, _MISSING_FORMATS)
                refuse_fractions(schema, "structured_outputs.json")
                refuse_open_bound(schema, "structured_outputs.json")
            else:
                # OpenAI's json_object means an object, never a top-level array or scalar.
                schema = {"type": "object"}
            return self._json_grammar(schema, params, kind)
        if kind == "regex":
            # As in xgrammar (and JSON-schema patterns), \d and \w are ASCII; llguidance's
            # own regex dialect would let \d{3} produce fullwidth or Devanagari digits.
            return llg.LLMatcher.grammar_from_lark(
                "start: /" + llg.regex_to_lark(params.regex, "dw") + "/"
            )
        if kind == "choice":
            return llg.LLMatcher.grammar_from_lark(choice_to_lark(params.choice))
        if kind == "grammar":
            # Rules that can never finish (`start: start "a"`) would compile and get stuck.
            check_grammar_text(params.grammar)
            if "::=" not in params.grammar:
                check_lark(params.grammar)
                return llg.LLMatcher.grammar_from_lark(params.grammar)
            try:
                lark = gbnf_to_lark(params.grammar)
            except Exception as e:  # the converter raises bare Exception for some errors
                raise UnsupportedConstraintError(
                    "structured_outputs.grammar",
                    f"{first_line(str(e))[:300]} (llguidance could not convert this EBNF)",
                ) from e
            return llg.LLMatcher.grammar_from_lark(lark)
        if kind == "structural_tag":
            fmt = parse_structural_tag(params.structural_tag)
            writer = LarkWriter(
                lambda schema: self._json_fragment(schema, params),
                lambda pattern: "/" + llg.regex_to_lark(pattern, "dw") + "/",
                self.vocab.added_tokens,
            )
            return llg.LLMatcher.grammar_from_lark(writer.grammar(fmt))
        raise GrammarCompileError("structured_outputs", f"unknown constraint {kind!r}")

    def _json_fragment(self, schema: Any, params: StructuredOutputsParams) -> str:
        """A JSON schema inside a structural tag as a Lark `%json` expression: normalized,
        checked and whitespace-bounded like a `json` constraint."""
        schema = normalize_json_schema(
            schema,
            disable_additional_properties=params.disable_additional_properties,
            one_of_as_any_of=self.options.one_of_as_any_of,
        )
        spell_out_min_properties(schema)
        spell_formats(schema, _MISSING_FORMATS)
        refuse_fractions(schema, "structured_outputs.structural_tag")
        refuse_open_bound(schema, "structured_outputs.structural_tag")
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarCompileError(
                "structured_outputs.structural_tag", "a tag's schema accepts no value"
            )
        schema = {k: v for k, v in schema.items() if k != "x-guidance"}
        refuse_escape_blind_patterns(schema, "structured_outputs.structural_tag")
        schema["x-guidance"] = self._json_options(params)
        return "%json " + json.dumps(schema, ensure_ascii=False)

    def _json_grammar(self, schema: Any, params: StructuredOutputsParams, kind: str) -> str:
        param = f"structured_outputs.{kind}"
        if schema is True:
            schema = {}
        if schema is False:
            raise GrammarCompileError(param, "the schema `false` accepts no value")
        if not isinstance(schema, dict):
            raise GrammarCompileError(
                param, f"a schema must be a JSON object, got {type(schema).__name__}"
            )
        # llguidance reads options from a top-level "x-guidance" key; a request must not be
        # able to loosen enforcement (lenient) or change the separators.
        schema = {k: v for k, v in schema.items() if k != "x-guidance"}
        refuse_escape_blind_patterns(schema, param)
        options = self._json_options(params)  # its InvalidRequestError names its own field
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except (ValueError, TypeError) as e:
            raise GrammarCompileError(param, clean_error(str(e))) from e

    def _json_options(self, params: StructuredOutputsParams) -> dict[str, Any]:
        """llguidance's JSON options (separators, whitespace) for a request."""
        options: dict[str, Any] = {
            "item_separator": ",",
            "key_separator": ":",
            "coerce_one_of": self.options.one_of_as_any_of,
            "lenient": False,
        }
        if self.options.disable_any_whitespace or params.disable_any_whitespace:
            options["whitespace_flexible"] = False
        else:
            options["whitespace_flexible"] = True
            pattern = self._whitespace_pattern(params)
            if pattern is not None:
                # Matched at most once at each place JSON allows whitespace, so a bound in
                # the pattern bounds each run.
                options["whitespace_pattern"] = pattern
        return options

    def _whitespace_pattern(self, params: StructuredOutputsParams) -> str | None:
        pattern = params.whitespace_pattern
        if pattern is not None:
            check_whitespace_pattern(pattern)
            return pattern
        limit = whitespace_limit(params, self.options)
        if limit is None:
            return None
        return r"[\x20\x0A\x0D\x09]{0,%d}" % limit


    # ------------------------------------------------------------------ bitmasks

    def fill_unterminated(
        self, grammars: list[StructuredOutputGrammar], bitmask: np.ndarray, rows: list[int]
    ) -> None:
        """Fills the rows, large batches in one multi-threaded llguidance call.

        Each grammar may appear once: llguidance raises RuntimeError ("Already borrowed")
        when one matcher is filled twice in a parallel call.
        """
        live: list[tuple[GuidanceGrammar, int]] = []
        for grammar, row in zip(grammars, rows, strict=True):
            assert isinstance(grammar, GuidanceGrammar)
            live.append((grammar, row))
        executor = self._parallel_executor() if len(live) >= _PARALLEL_FILL_MIN else None
        if executor is not None:
            llg_numpy.fill_next_token_bitmask_par(
                executor, [(g.matcher, row) for g, row in live], bitmask
            )
        else:
            for grammar, row in live:
                llg_numpy.fill_next_token_bitmask(grammar.matcher, bitmask, row)
        # GuidanceGrammar.fix_row for the whole batch at once.
        vocab = self.vocab
        live_rows = np.array(rows, dtype=np.int64)
        bitmask[np.ix_(live_rows, vocab.fix_words)] &= vocab.fix_keep
        stops = bitmask[np.ix_(live_rows, vocab.stop_words)]
        for i in np.flatnonzero((stops & vocab.stop_bits).any(axis=1)):
            grammar, row = live[i]
            if not grammar.matcher.is_accepting():
                bitmask[row, vocab.stop_words] &= ~vocab.stop_bits

    def _parallel_executor(self) -> llg.LLExecutor | None:
        """The executor of this process, created on first use.

        A process forked after the executor started (a compile worker) has none of its
        threads, and a parallel fill there would wait forever: it gets its own executor.
        """
        if self._destroyed:
            return None
        pid = os.getpid()
        if self._executor is None or self._executor_pid != pid:
            self._executor = llg.LLExecutor(self._threads)
            self._executor_pid = pid
        return self._executor

    def destroy(self) -> None:
        """Drops the helper threads; later fills run on the calling thread. Grammars already
        compiled keep working."""
        self._executor = None
        self._destroyed = True
