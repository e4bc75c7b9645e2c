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

Tokens the model may never write inside a constraint (the tokenizer's added and special
tokens other than the stop ids, and ids past the tokenizer's vocabulary) are masked, and
strings bounded by minLength/maxLength never contain raw control characters (xgrammar 0.2.9
allows them there, which is invalid JSON).

Known xgrammar 0.2.9 bug left as is: inside a JSON-schema `pattern`, a ranged repeat followed
by an optional group holding another one (`^\\d{1,3}(\\.\\d{1,3})?$`) can accept strings the
pattern rejects ("910.22730"). Top-level `regex` constraints compile correctly.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import xgrammar as xgr

from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
)

logger = logging.getLogger(__name__)

# Bounds the compiled-grammar cache of a long-running server (a compiled grammar is ~0.3 MB).
_CACHE_LIMIT_BYTES = 512 * 1024 * 1024

# xgrammar accepts these keywords but does not enforce them.
_UNENFORCED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_SINGLES = ("additionalProperties", "items", "additionalItems", "propertyNames")
# xgrammar 0.2.9 lets raw control characters into strings bounded by minLength/maxLength or
# propertyNames (invalid JSON): its grammar uses this character class for them. The compiler
# swaps in one that also excludes U+0000-U+001F (as printed in, and parsed from, xgrammar EBNF).
_LOOSE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_STRICT_STRING_CHAR = '[^\\"\\\\\\0-\\x1f]'

# Batches at least this large fill their bitmasks on several threads.
_PARALLEL_FILL_MIN = 64

_LOG_PREFIX = re.compile(r"\[[0-9:]+\] \S+?:\d+: ")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false: ")


def find_lookaround(regex: str) -> str | None:
    """Returns the first lookaround group opener (`(?=`, `(?!`, `(?<=`, `(?<!`) in `regex`."""
    i, in_class = 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            # A "]" right after "[" or "[^" is a literal member of the class.
            if regex[i + 1 : i + 2] == "^":
                i += 1
            if regex[i + 1 : i + 2] == "]":
                i += 1
        elif c == "(":
            for opener in ("(?=", "(?!", "(?<=", "(?<!"):
                if regex.startswith(opener, i):
                    return opener
        i += 1
    return None


def prepare_json_schema(
    schema: dict[str, Any] | bool, *, disable_additional_properties: bool = False
) -> dict[str, Any] | bool:
    """Returns a copy of `schema` ready for xgrammar.

    Raises ValueError naming the location and keyword when the schema uses a feature xgrammar
    would not enforce. With `disable_additional_properties`, object schemas get
    `additionalProperties: false` unless they set it.
    """
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise ValueError(
            f"structured_outputs.json: a schema must be a JSON object, got {type(schema).__name__}"
        )
    out = copy.deepcopy(schema)
    _prepare_node(out, "#", disable_additional_properties)
    return out


def _prepare_node(node: Any, path: str, no_extra: bool) -> None:
    if not isinstance(node, dict):
        return

    def bad(why: str) -> ValueError:
        return ValueError(f"structured_outputs.json: at {path}: {why} (unsupported by xgrammar)")

    for key in _UNENFORCED_KEYWORDS:
        if key in node:
            raise bad(f"the {key!r} keyword is not supported")
    if node.get("uniqueItems") is True and node.get("maxItems", 2) > 1:
        raise bad("'uniqueItems: true' is not supported")
    if "multipleOf" in node:
        whole = isinstance(node["multipleOf"], int) and not isinstance(node["multipleOf"], bool)
        if not whole or node.get("type") != "integer":
            raise bad("'multipleOf' is only supported on integers (type 'integer', whole divisor)")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise bad("'allOf' with more than one schema is not supported")
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        patterns += list(node["patternProperties"])
    for pattern in patterns:
        opener = find_lookaround(pattern)
        if opener is not None:
            raise bad(f"pattern {pattern!r} uses a lookaround {opener!r}")
    if "minLength" in node or "maxLength" in node:
        for key in ("pattern", "format"):
            if key in node:
                raise bad(f"{key!r} combined with minLength/maxLength is not supported")
    if no_extra and "additionalProperties" not in node:
        if node.get("type") == "object" or "properties" in node:
            node["additionalProperties"] = False

    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _prepare_node(sub, f"{path}/{key}/{name}", no_extra)
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                _prepare_node(sub, f"{path}/{key}/{i}", no_extra)
    for key in _SCHEMA_SINGLES:
        _prepare_node(node.get(key), f"{path}/{key}", no_extra)


def choice_to_ebnf(choices: Sequence[str]) -> str:
    """Returns an EBNF grammar whose language is exactly the strings in `choices`."""
    # JSON string escapes (\", \\, \n, \uXXXX) are valid EBNF string-literal escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def normalize_structural_tag(value: str | dict[str, Any]) -> str:
    """Returns the structural tag as a JSON string in xgrammar 0.2.9's format.

    Raises ValueError when it is not a JSON object or a legacy tag is malformed.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.structural_tag: not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError("structured_outputs.structural_tag: must be a JSON object")
    if "structures" in value:
        try:
            items = [
                xgr.StructuralTagItem(begin=s["begin"], schema=s["schema"], end=s["end"])
                for s in value["structures"]
            ]
            tag = xgr.StructuralTag.from_legacy_structural_tag(items, list(value["triggers"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                "structured_outputs.structural_tag: legacy tags need 'structures' "
                f"(each with begin, schema, end) and 'triggers': {e}"
            ) from e
        return tag.model_dump_json()
    if "format" in value and "type" not in value:
        value = {"type": "structural_tag", **value}
    return json.dumps(value)


def _clean_error(e: BaseException) -> str:
    """xgrammar's messages carry a log prefix and source location; users need the cause."""
    msg = _CHECK_FAILED.sub("", _LOG_PREFIX.sub("", str(e))).strip()
    msg = msg.split(" The JSON string is:")[0].strip()
    return msg[:500] or type(e).__name__


def build_tokenizer_info(
    tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
) -> tuple[xgr.TokenizerInfo, frozenset[int]]:
    """Returns xgrammar's view of the vocabulary and the ids it must never allow.

    Added and special tokens other than the stop ids become empty strings, which xgrammar
    treats as special (never allowed); otherwise it would treat `<|im_start|>` or `<think>` as
    literal text. Ids past the tokenizer's vocabulary are empty too.
    Raises ValueError when the tokenizer has no vocabulary.
    """
    try:
        vocab: dict[str, int] = tokenizer.get_vocab()
    except AttributeError as e:
        raise ValueError(
            f"structured outputs: tokenizer {type(tokenizer)} has no vocabulary"
        ) from e
    stops = sorted({int(t) for t in stop_token_ids})
    base = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stops or None
    )
    stop_set = set(base.stop_token_ids)
    encoded = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size:
            encoded[idx] = token
    control = set(getattr(tokenizer, "added_tokens_decoder", None) or {})
    control.update(getattr(tokenizer, "all_special_ids", None) or [])
    for idx in control - stop_set:
        if 0 <= idx < vocab_size:
            encoded[idx] = ""
    info = xgr.TokenizerInfo.from_vocab_and_metadata(encoded, base.dump_metadata())
    masked = frozenset(i for i, s in enumerate(encoded) if not s and i not in stop_set)
    return info, masked


class XgrammarGrammar(StructuredOutputGrammar):
    """One request's xgrammar matcher plus the bookkeeping the scheduler needs."""

    def __init__(
        self, matcher: xgr.GrammarMatcher, vocab_size: int, masked_token_ids: frozenset[int]
    ) -> None:
        self.matcher = matcher
        self._vocab_size = vocab_size
        self._masked = masked_token_ids
        self._num_processed = 0
        self._terminated = False

    @property
    def num_processed_tokens(self) -> int:
        return self._num_processed

    def _accept(self, token: int) -> bool:
        # Checked here because xgrammar logs a warning for every masked token it rejects.
        if not 0 <= token < self._vocab_size or token in self._masked:
            return False
        return self.matcher.accept_token(token)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advances by `tokens`; returns False (and logs) at the first rejected token."""
        for token in tokens:
            if self._terminated or not self._accept(token):
                logger.error(
                    "request %s: the grammar rejected token %d after %d tokens%s",
                    request_id,
                    token,
                    self._num_processed,
                    " (already terminated)" if self._terminated else "",
                )
                return False
            self._num_processed += 1
            self._terminated = self.matcher.is_terminated()
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """Returns the longest accepted prefix of `tokens`; the state is unchanged."""
        if self._terminated:
            return []
        accepted: list[int] = []
        for token in tokens:
            if not self._accept(token):
                break
            accepted.append(token)
            if self.matcher.is_terminated():
                break
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` tokens. Raises ValueError past the start."""
        if not 0 <= num_tokens <= self._num_processed:
            raise ValueError(
                f"rollback: num_tokens must be in [0, {self._num_processed}], got {num_tokens}"
            )
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self._num_processed -= num_tokens
            self._terminated = self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]`."""
        if self._terminated:
            bitmask[row] = -1
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._terminated

    def reset(self) -> None:
        """Returns to the initial state."""
        self.matcher.reset()
        self._num_processed = 0
        self._terminated = False


class XgrammarBackend(StructuredOutputBackend):
    """Compiles constraints with one caching xgrammar compiler per engine.

    Building it costs about a second (xgrammar's view of the vocabulary); the manager does it
    on the first structured request. Raises ValueError when the tokenizer has no vocabulary.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        disable_any_whitespace: bool = False,
        max_threads: int = 2,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size: must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.disable_any_whitespace = disable_any_whitespace
        info, self.masked_token_ids = build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.stop_token_ids: tuple[int, ...] = tuple(info.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(
            info, max_threads=max_threads, cache_limit_bytes=_CACHE_LIMIT_BYTES
        )
        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)
        self._batch_serial = xgr.BatchGrammarMatcher(max_threads=1)

    def compile_grammar(self, params: StructuredOutputsParams) -> XgrammarGrammar:
        """Compiles `params` (cached by content). Raises ValueError naming the field."""
        kind = params.kind
        try:
            compiled = self._compile(params, kind)
        except ValueError as e:
            if str(e).startswith("structured_outputs."):
                raise
            raise ValueError(f"structured_outputs.{kind}: {_clean_error(e)}") from e
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind}: {_clean_error(e)}") from e
        return XgrammarGrammar(xgr.GrammarMatcher(compiled), self.vocab_size, self.masked_token_ids)

    def _compile(self, params: StructuredOutputsParams, kind: str) -> xgr.CompiledGrammar:
        compact = self.disable_any_whitespace or params.disable_any_whitespace
        if kind == "json":
            schema = params.json if isinstance(params.json, dict) else json.loads(params.json)
            schema = prepare_json_schema(
                schema, disable_additional_properties=params.disable_additional_properties
            )
            return self._compile_schema(json.dumps(schema), compact)
        if kind == "json_object":
            # OpenAI's json_object means an object; xgrammar's builtin JSON grammar would
            # also allow a top-level array.
            return self._compile_schema('{"type": "object"}', compact)
        if kind == "regex":
            opener = find_lookaround(params.regex)
            if opener is not None:
                raise ValueError(
                    f"structured_outputs.regex: lookaround {opener!r} is not supported by xgrammar"
                )
            return self.compiler.compile_regex(params.regex)
        if kind == "choice":
            return self.compiler.compile_grammar(choice_to_ebnf(params.choice))
        if kind == "grammar":
            if "::=" in params.grammar:
                return self.compiler.compile_grammar(params.grammar)
            return self.compiler.compile_lark(params.grammar)
        if kind == "structural_tag":
            return self.compiler.compile_structural_tag(
                normalize_structural_tag(params.structural_tag)
            )
        raise ValueError(f"structured_outputs: unknown constraint {kind!r}")

    def _compile_schema(self, schema: str, compact: bool) -> xgr.CompiledGrammar:
        style: dict[str, Any] = {"any_whitespace": not compact}
        if compact:
            style["separators"] = (",", ":")
        # Converting alone takes ~0.1 ms; compiling is cached either way.
        ebnf = str(xgr.Grammar.from_json_schema(schema, **style))
        if _LOOSE_STRING_CHAR in ebnf:
            return self.compiler.compile_grammar(
                ebnf.replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR)
            )
        return self.compiler.compile_json_schema(schema, **style)

    def fill_bitmasks(
        self, grammars: Sequence[StructuredOutputGrammar | None], bitmask: np.ndarray
    ) -> None:
        """Fills every row in one multi-threaded xgrammar call (rows of finished ones: all ones)."""
        matchers: list[xgr.GrammarMatcher] = []
        rows: list[int] = []
        for row, grammar in enumerate(grammars):
            if isinstance(grammar, XgrammarGrammar) and not grammar.is_terminated():
                matchers.append(grammar.matcher)
                rows.append(row)
            elif grammar is None or grammar.is_terminated():
                bitmask[row] = -1
            else:
                grammar.fill_bitmask(bitmask, row)
        if matchers:
            # Waking helper threads costs more than it saves for small batches (up to
            # milliseconds when the cores are busy).
            batch = self._batch if len(matchers) >= _PARALLEL_FILL_MIN else self._batch_serial
            batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def destroy(self) -> None:
        """Drops the compiled-grammar cache."""
        self.compiler.clear_cache()
