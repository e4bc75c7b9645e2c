"""The xgrammar structured-output backend: compiles constraints into token-bitmask matchers.

Supported constraints (`StructuredOutputsParams`):

- `json`: a JSON schema (dict or string), compiled in xgrammar's strict mode (properties and
  items the schema does not list are not generated). `disable_any_whitespace` (per request or
  engine-wide) gives compact JSON (`{"a":1,"b":[2,3]}`); `disable_additional_properties` sets
  `additionalProperties: false` on every object schema that does not say otherwise. Keywords
  xgrammar 0.2.9 silently ignores (so outputs could violate the schema) are rejected with a
  ValueError: `not`, `if`/`then`/`else`, `contains`, `dependentRequired`, `dependentSchemas`,
  `uniqueItems: true`, `multipleOf` on non-integers, `allOf` with several schemas, regex
  lookarounds in `pattern`, and `pattern`/`format` combined with `minLength`/`maxLength`.
  `oneOf` is enforced as `anyOf`.
- `json_object`: any JSON object (schema `{"type": "object"}`, so whitespace options apply).
- `regex`: the whole output matches the regex (xgrammar's dialect: no lookarounds,
  backreferences, word boundaries or inline flags).
- `choice`: the output is exactly one of the strings.
- `grammar`: an EBNF grammar in xgrammar's dialect (GBNF-like, `root ::= ...`), or a Lark
  grammar with a `start` rule when the text has no `::=`.
- `structural_tag`: a dict or JSON string in xgrammar 0.2.9's format,
  `{"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f="],
  "tags": [{"begin": "<f=a>", "content": {"type": "json_schema", "json_schema": {...}},
  "end": "</f>"}]}}` (see `xgrammar.structural_tag` for every format type); the legacy form
  `{"structures": [{"begin": ..., "schema": {...}, "end": ...}], "triggers": [...]}` is
  converted to it.

Tokens the model may never write inside a constraint (the tokenizer's special tokens other
than the stop ids, and ids past the tokenizer's vocabulary) are masked, and
strings bounded by minLength/maxLength never contain raw control characters (xgrammar 0.2.9
allows them there, which is invalid JSON).

Outputs are valid UTF-8: xgrammar 0.2.9 accepts a few byte sequences that are not (encoded
surrogates `ED A0..BF xx` everywhere; overlong `E0 80..9F xx` and `F0 80..8F xx xx` inside
JSON-schema patterns), which decode to several U+FFFD each, so a string with `maxLength: 8`
could come back 10 characters long. The grammar masks the tokens that would complete them.

Constraints that no output can satisfy are rejected with a ValueError instead of producing
an empty or invalid output: an empty `anyOf`/`oneOf`/`enum`/`type` list, the schema `false`,
a required property the schema forbids, minimum above maximum (and the like), a grammar rule
that can never finish (`root ::= root "a"`: left-recursive or cyclic with no way out), and any
compiled constraint whose first step allows no token (for JSON: allows only an empty output).

Known xgrammar 0.2.9 bug: inside a JSON-schema `pattern`, a ranged repeat together with an
optional or repeated group (`^\\d{1,3}(\\.\\d{1,3})?$`) can accept strings the pattern rejects
("910.22730"), so such patterns are refused here (the `auto` backend gives them to
llguidance). Top-level `regex` constraints compile correctly.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xgrammar as xgr

from vllm.exceptions import (
    GrammarCompileError,
    InvalidRequestError,
    UnsupportedConstraintError,
)
from vllm.sampling_params import StructuredOutputsParams
from vllm.transformers_utils.tokenizer import control_token_ids
from vllm.v1.structured_output.backends.base import (
    BackendOptions,
    BackendSetup,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    tokenizer_vocab,
)
from vllm.v1.structured_output.backends.utf8_guard import Utf8Guard
from vllm.v1.structured_output.schema.for_xgrammar import adapt_for_xgrammar, write_fraction_rules
from vllm.v1.structured_output.schema.grammar_checks import check_grammar_text, find_lookaround
from vllm.v1.structured_output.schema.normalize import check_xgrammar_support, normalize_json_schema

logger = logging.getLogger(__name__)

# How a grammar that does not parse is reported (upstream vLLM's wording, then the cause).
GRAMMAR_FAILED = "Failed to convert the grammar"
# Bounds the compiled-grammar cache of a long-running server (a compiled grammar is ~0.3 MB).
_CACHE_LIMIT_BYTES = 512 * 1024 * 1024

# xgrammar 0.2.9 lets raw control characters into strings bounded by minLength/maxLength or
# propertyNames (invalid JSON): its grammar uses this character class for them. The compiler
# swaps in one that also excludes U+0000-U+001F (as printed in, and parsed from, xgrammar EBNF).
_LOOSE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_STRICT_STRING_CHAR = '[^\\"\\\\\\0-\\x1f]'

# Batches at least this large fill their bitmasks on several threads.
_PARALLEL_FILL_MIN = 64

_LOG_PREFIX = re.compile(r"\[[0-9:]+\] \S+?:\d+: ")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false: ")


def has_xgrammar_unsupported_json_features(schema: dict[str, Any] | str | bool) -> bool:
    """Whether the JSON schema uses a feature xgrammar cannot enforce exactly (the keywords
    listed in this module's docstring, an overlapping `oneOf`, an unsafe `pattern`): True
    means a request with it goes to llguidance under the `auto` backend, or is refused by
    the `xgrammar` backend.

    `schema` is a dict, a boolean schema or its JSON text. A schema no value can satisfy
    uses no unsupported feature (False; compiling it raises). Raises ValueError naming
    `schema` when it is not JSON or not a schema.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"schema: not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"schema: must be a JSON object or boolean, got {type(schema).__name__}")
    try:
        normalized = normalize_json_schema(schema)
        adapt_for_xgrammar(normalized)
        check_xgrammar_support(normalized)
    except UnsupportedConstraintError:
        return True
    except GrammarCompileError:
        return False  # unsatisfiable, not unsupported
    return False


def choice_to_ebnf(choices: Sequence[str]) -> str:
    """Returns an EBNF grammar whose language is exactly the strings in `choices`."""
    # JSON string escapes (\", \\, \n, \uXXXX) are valid EBNF string-literal escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def normalize_structural_tag(
    value: str | dict[str, Any], *, schema_grammar: Callable[[Any], str] | None = None
) -> str:
    """Returns the structural tag as a JSON string in xgrammar 0.2.9's format.

    With `schema_grammar`, every JSON schema inside is replaced by the EBNF grammar it
    returns (so the schema is normalized, checked and whitespace-bounded like a `json`
    constraint).
    Raises ValueError when it is not a JSON object or a legacy tag is malformed, and what
    `schema_grammar` raises.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarCompileError(
                "structured_outputs.structural_tag",
                f"not valid JSON: {e}"
            ) from e
    if not isinstance(value, dict):
        raise GrammarCompileError("structured_outputs.structural_tag", "must be a JSON object")
    if "structures" in value:
        try:
            items = [
                xgr.StructuralTagItem(begin=s["begin"], schema=s["schema"], end=s["end"])
                for s in value["structures"]
            ]
            tag = xgr.StructuralTag.from_legacy_structural_tag(items, list(value["triggers"]))
        except (KeyError, TypeError, ValueError) as e:
            raise GrammarCompileError(
                "structured_outputs.structural_tag",
                "legacy tags need 'structures' "
                f"(each with begin, schema, end) and 'triggers': {e}"
            ) from e
        value = json.loads(tag.model_dump_json())
    if "format" in value and "type" not in value:
        value = {"type": "structural_tag", **value}
    if schema_grammar is not None:
        _replace_schemas(value, schema_grammar)
    return json.dumps(value)


def _replace_schemas(node: Any, schema_grammar: Callable[[Any], str]) -> None:
    children = node if isinstance(node, list) else (
        node.values() if isinstance(node, dict) else ())
    for child in children:
        if isinstance(child, dict) and child.get("type") == "json_schema" and "json_schema" in child:
            grammar = schema_grammar(child["json_schema"])
            child.clear()
            child.update(type="grammar", grammar=grammar)
        else:
            _replace_schemas(child, schema_grammar)


def _clean_error(e: BaseException) -> str:
    """xgrammar's messages carry a log prefix and source location; users need the cause."""
    msg = _CHECK_FAILED.sub("", _LOG_PREFIX.sub("", str(e))).strip()
    msg = msg.split(" The JSON string is:")[0].strip()
    return msg[:500] or type(e).__name__


def _build_tokenizer_info(
    tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
) -> tuple[xgr.TokenizerInfo, frozenset[int], list[str]]:
    """xgrammar's view of the vocabulary, the ids it must never allow, and each id's text.

    Special tokens other than the stop ids become empty strings, which xgrammar treats as
    special (never allowed); otherwise it would treat `<|im_start|>` as literal text. Added
    tokens that are not special (`<think>`, `<tool_call>`) keep their text, so a structural
    tag can begin with the very token a model writes. Ids past the tokenizer's vocabulary
    are empty too.
    Raises ValueError when the tokenizer has no vocabulary.
    """
    vocab = tokenizer_vocab(tokenizer)
    stops = sorted({int(t) for t in stop_token_ids})
    base = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stops or None
    )
    stop_set = set(base.stop_token_ids)
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size:
            encoded[idx] = token
    control = control_token_ids(tokenizer)
    for idx in control - stop_set:
        if 0 <= idx < vocab_size:
            encoded[idx] = ""
    info = xgr.TokenizerInfo.from_vocab_and_metadata(encoded, base.dump_metadata())
    masked = frozenset(i for i, s in enumerate(encoded) if not s and i not in stop_set)
    return info, masked, encoded

@dataclass(frozen=True)
class PreparedVocab:
    """Everything a backend needs from the tokenizer, built once (about two seconds).

    Plain data: a process that built it can fork compile workers that share it.
    """

    info: xgr.TokenizerInfo
    masked_token_ids: frozenset[int]
    utf8_guard: Utf8Guard
    vocab_size: int

    @classmethod
    def build(
        cls, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> PreparedVocab:
        """Raises ValueError when the tokenizer has no vocabulary or vocab_size < 1."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size: must be positive, got {vocab_size}")
        info, masked, encoded = _build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        return cls(info, masked, Utf8Guard.from_vocab(info, encoded), vocab_size)


class XgrammarGrammar(StructuredOutputGrammar):
    """One request's xgrammar matcher plus the bookkeeping the scheduler needs."""

    def __init__(
        self,
        matcher: xgr.GrammarMatcher,
        vocab_size: int,
        masked_token_ids: frozenset[int],
        utf8_guard: Utf8Guard | None = None,
    ) -> None:
        self.matcher = matcher
        self._vocab_size = vocab_size
        self._masked = masked_token_ids
        self._guard = utf8_guard
        # The guard state after each accepted token (see Utf8Guard), so rollback restores it.
        self._states: list[int] = []
        self._terminated = False

    @property
    def num_processed_tokens(self) -> int:
        return len(self._states)

    @property
    def utf8_state(self) -> int:
        """The Utf8Guard state after the accepted tokens (0: no restriction)."""
        return self._states[-1] if self._states else 0

    def _accept(self, token: int, state: int) -> bool:
        # Checked here because xgrammar logs a warning for every masked token it rejects.
        if not 0 <= token < self._vocab_size or token in self._masked:
            return False
        if state and self._guard.forbidden[state][token]:
            return False
        return self.matcher.accept_token(token)

    def _state_after(self, token: int) -> int:
        return int(self._guard.state_after[token]) if self._guard is not None else 0

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advances by `tokens`; returns False (and logs) at the first rejected token."""
        for token in tokens:
            if self._terminated or not self._accept(token, self.utf8_state):
                logger.error(
                    "request %s: the grammar rejected token %d after %d tokens%s",
                    request_id,
                    token,
                    len(self._states),
                    " (already terminated)" if self._terminated else "",
                )
                return False
            self._states.append(self._state_after(token))
            self._terminated = self.matcher.is_terminated()
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """Returns the longest accepted prefix of `tokens`; the state is unchanged."""
        if self._terminated:
            return []
        accepted: list[int] = []
        state = self.utf8_state
        for token in tokens:
            if not self._accept(token, state):
                break
            accepted.append(token)
            state = self._state_after(token)
            if self.matcher.is_terminated():
                break
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def jump_forward_tokens(self) -> list[int]:
        """The forced continuation in xgrammar's tokenization (longest tokens first), cut
        where this grammar's own checks (masked ids, the UTF-8 guard) would refuse it."""
        if self._terminated:
            return []
        return self.validate_tokens(self.matcher.find_jump_forward_tokens())

    def forced_string(self) -> str:
        """xgrammar's jump-forward string: the forced text, whole characters only."""
        if self._terminated:
            return ""
        return self.matcher.find_jump_forward_string()

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` tokens. Raises ValueError past the start."""
        if not 0 <= num_tokens <= len(self._states):
            raise ValueError(
                f"rollback: num_tokens must be in [0, {len(self._states)}], got {num_tokens}"
            )
        if num_tokens:
            self.matcher.rollback(num_tokens)
            del self._states[-num_tokens:]
            self._terminated = self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]`."""
        if self._terminated:
            bitmask[row] = -1
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.apply_utf8_guard(bitmask, row)

    def apply_utf8_guard(self, bitmask: np.ndarray, row: int) -> None:
        """Clears the tokens that would make the output invalid UTF-8 from `bitmask[row]`."""
        state = self.utf8_state
        if state:
            bitmask[row] &= self._guard.allowed[state]

    def is_terminated(self) -> bool:
        return self._terminated


class XgrammarBackend(StructuredOutputBackend):
    """Compiles constraints with one caching xgrammar compiler per engine.

    Building it costs about two seconds (xgrammar's view of the vocabulary) unless `vocab`
    is given; the manager does it on the first structured request. Raises ValueError when the
    tokenizer has no vocabulary.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        options: BackendOptions = BackendOptions(),
        *,
        cache_limit_bytes: int = _CACHE_LIMIT_BYTES,
        vocab: PreparedVocab | None = None,
    ) -> None:
        if vocab is None:
            vocab = PreparedVocab.build(tokenizer, vocab_size, stop_token_ids)
        elif vocab.vocab_size != vocab_size:
            raise ValueError(f"vocab_size: {vocab_size} differs from the prepared vocabulary's")
        threads = options.threads()
        self.vocab_size = vocab_size
        self.vocab = vocab
        self.options = options
        self.masked_token_ids = vocab.masked_token_ids
        self.stop_token_ids: tuple[int, ...] = tuple(vocab.info.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(
            vocab.info, max_threads=threads, cache_limit_bytes=cache_limit_bytes
        )
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self._batch_serial = xgr.BatchGrammarMatcher(max_threads=1)

    @classmethod
    def prepare(
        cls, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> PreparedVocab:
        """xgrammar's view of the vocabulary (about two seconds), shared by forked workers."""
        return PreparedVocab.build(tokenizer, vocab_size, stop_token_ids)

    @classmethod
    def create(cls, setup: BackendSetup) -> XgrammarBackend:
        """Builds the backend, from the prepared vocabulary when `setup` has one (then its
        tokenizer may be None)."""
        extra: dict[str, Any] = {"vocab": setup.prepared}
        if setup.cache_limit_bytes is not None:
            extra["cache_limit_bytes"] = setup.cache_limit_bytes
        return cls(
            setup.tokenizer, setup.vocab_size, setup.stop_token_ids, setup.options, **extra
        )

    def compile_grammar(self, params: StructuredOutputsParams) -> XgrammarGrammar:
        """Compiles `params` (cached by content). Raises GrammarCompileError naming the field
        when it does not compile or no output can satisfy it, InvalidRequestError when it is
        malformed."""
        kind = params.kind
        if params.whitespace_pattern is not None:
            raise UnsupportedConstraintError(
                "structured_outputs.whitespace_pattern",
                "not supported by xgrammar (use max_whitespace, or the guidance backend)",
            )
        try:
            compiled = self._compile(params, kind)
        except InvalidRequestError:
            raise  # found by our own checks, already naming its field
        except (ValueError, RuntimeError, TypeError) as e:
            # xgrammar's own parse and compile errors: the constraint's fault, named by kind
            # (a grammar's in upstream's words, so clients matching them still do).
            message = _clean_error(e)
            if kind == "grammar":
                message = f"{GRAMMAR_FAILED}: {message}"
            raise GrammarCompileError(f"structured_outputs.{kind}", message) from e
        grammar = XgrammarGrammar(
            xgr.GrammarMatcher(compiled), self.vocab_size, self.masked_token_ids,
            self.vocab.utf8_guard,
        )
        self._check_first_step(grammar, kind)
        return grammar

    def _check_first_step(self, grammar: XgrammarGrammar, kind: str) -> None:
        """Raises ValueError when the grammar allows no first token at all, or (JSON) only a
        stop token: an empty output."""
        row = np.zeros((1, (self.vocab_size + 31) // 32), dtype=np.int32)
        grammar.matcher.fill_next_token_bitmask(row, 0)
        if not row.any():
            raise GrammarCompileError(
                f"structured_outputs.{kind}",
                "the constraint accepts no output at all"
            )
        if kind in ("json", "json_object"):
            bits = np.unpackbits(row.view(np.uint8), bitorder="little")
            bits[[t for t in self.stop_token_ids if t < bits.size]] = 0
            if not bits.any():
                raise GrammarCompileError(
                    f"structured_outputs.{kind}",
                    "the schema accepts only an empty output, "
                    "which is not JSON"
                )

    def _compile(self, params: StructuredOutputsParams, kind: str) -> xgr.CompiledGrammar:
        compact = self.options.disable_any_whitespace or params.disable_any_whitespace
        max_ws = params.max_whitespace
        if max_ws is None:
            max_ws = self.options.max_whitespace
        if kind == "json":
            schema = params.json if isinstance(params.json, dict) else json.loads(params.json)
            return self._compile_schema(json.dumps(self._exact(schema, params)), compact, max_ws)
        if kind == "json_object":
            # OpenAI's json_object means an object; xgrammar's builtin JSON grammar would
            # also allow a top-level array.
            return self._compile_schema('{"type": "object"}', compact, max_ws)
        if kind == "regex":
            opener = find_lookaround(params.regex)
            if opener is not None:
                raise GrammarCompileError(
                    "structured_outputs.regex",
                    f"lookaround {opener!r} is not supported by xgrammar"
                )
            return self.compiler.compile_regex(params.regex)
        if kind == "choice":
            return self.compiler.compile_grammar(choice_to_ebnf(params.choice))
        if kind == "grammar":
            check_grammar_text(params.grammar)
            if "::=" in params.grammar:
                return self.compiler.compile_grammar(params.grammar)
            return self.compiler.compile_lark(params.grammar)
        if kind == "structural_tag":

            def schema_grammar(schema: Any) -> str:
                exact = json.dumps(self._exact(schema, params))
                return self._schema_ebnf(exact, compact, max_ws)[0]

            tag = normalize_structural_tag(params.structural_tag, schema_grammar=schema_grammar)
            return self.compiler.compile_structural_tag(tag)
        raise GrammarCompileError("structured_outputs", f"unknown constraint {kind!r}")

    def _exact(self, schema: Any, params: StructuredOutputsParams) -> Any:
        """The schema with exact semantics for xgrammar; raises UnsupportedConstraintError
        when xgrammar cannot enforce a keyword (see json_schema.py)."""
        schema = normalize_json_schema(
            schema,
            disable_additional_properties=params.disable_additional_properties,
            one_of_as_any_of=self.options.one_of_as_any_of,
        )
        adapt_for_xgrammar(schema)
        check_xgrammar_support(schema)
        return schema

    @staticmethod
    def _style(compact: bool, max_whitespace: int | None) -> dict[str, Any]:
        style: dict[str, Any] = {"any_whitespace": not compact and max_whitespace != 0}
        if not style["any_whitespace"]:
            style["separators"] = (",", ":")
        elif max_whitespace is not None:
            style["max_whitespace_cnt"] = max_whitespace
        return style

    def _schema_ebnf(
        self, schema: str, compact: bool, max_whitespace: int | None
    ) -> tuple[str, bool]:
        """The EBNF of a JSON schema, with strings that never hold raw control characters and
        the rules of marked numbers (`adapt_for_xgrammar`), and whether that took a change to
        xgrammar's own conversion."""
        ebnf = str(xgr.Grammar.from_json_schema(schema, **self._style(compact, max_whitespace)))
        # Asked before replacing: xgrammar's output may hold the strict class already.
        loose = _LOOSE_STRING_CHAR in ebnf
        ebnf, fractions = write_fraction_rules(ebnf.replace(_LOOSE_STRING_CHAR,
                                                            _STRICT_STRING_CHAR))
        return ebnf, loose or fractions

    def _compile_schema(
        self, schema: str, compact: bool, max_whitespace: int | None
    ) -> xgr.CompiledGrammar:
        # Converting alone takes ~0.1 ms; compiling is cached either way.
        ebnf, changed = self._schema_ebnf(schema, compact, max_whitespace)
        if changed:
            return self.compiler.compile_grammar(ebnf)
        return self.compiler.compile_json_schema(schema, **self._style(compact, max_whitespace))

    def fill_unterminated(
        self, grammars: list[StructuredOutputGrammar], bitmask: np.ndarray, rows: list[int]
    ) -> None:
        """Fills the rows in one multi-threaded xgrammar call, then applies UTF-8 guards."""
        matchers: list[xgr.GrammarMatcher] = []
        guarded: list[tuple[XgrammarGrammar, int]] = []
        for grammar, row in zip(grammars, rows, strict=True):
            assert isinstance(grammar, XgrammarGrammar)
            matchers.append(grammar.matcher)
            if grammar.utf8_state:
                guarded.append((grammar, row))
        # Waking helper threads costs more than it saves for small batches (up to
        # milliseconds when the cores are busy).
        batch = self._batch if len(matchers) >= _PARALLEL_FILL_MIN else self._batch_serial
        batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        for grammar, row in guarded:
            grammar.apply_utf8_guard(bitmask, row)

    def destroy(self) -> None:
        """Drops the compiled-grammar cache."""
        self.compiler.clear_cache()
