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

Outputs are valid UTF-8: xgrammar 0.2.9 accepts a few byte sequences that are not (encoded
surrogates `ED A0..BF xx` everywhere; overlong `E0 80..9F xx` and `F0 80..8F xx xx` inside
JSON-schema patterns), which decode to several U+FFFD each, so a string with `maxLength: 8`
could come back 10 characters long. The grammar masks the tokens that would complete them.

Constraints that no output can satisfy are rejected with a ValueError instead of producing
an empty or invalid output: an empty `anyOf`/`oneOf`/`enum`/`type` list, the schema `false`,
a required property the schema forbids, minimum above maximum (and the like), a grammar rule
that can never finish (`root ::= root "a"`: left-recursive or cyclic with no way out), and any
compiled constraint whose first step allows no token (for JSON: allows only an empty output).

Known xgrammar 0.2.9 bug left as is: inside a JSON-schema `pattern`, a ranged repeat followed
by an optional group holding another one (`^\\d{1,3}(\\.\\d{1,3})?$`) can accept strings the
pattern rejects ("910.22730"). Top-level `regex` constraints compile correctly.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xgrammar as xgr

from vllm.exceptions import GrammarCompileError, InvalidRequestError
from vllm.thread_policy import helper_threads
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
    would not enforce, or when no value can satisfy it (see `_check_satisfiable`). With
    `disable_additional_properties`, object schemas get `additionalProperties: false` unless
    they set it.
    """
    if schema is False:
        raise GrammarCompileError("structured_outputs.json", "the schema `false` accepts no value")
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise GrammarCompileError(
            "structured_outputs.json",
            f"a schema must be a JSON object, got {type(schema).__name__}"
        )
    out = copy.deepcopy(schema)
    _prepare_node(out, "#", disable_additional_properties)
    return out


def _prepare_node(node: Any, path: str, no_extra: bool) -> None:
    if not isinstance(node, dict):
        return

    def bad(why: str) -> ValueError:
        return GrammarCompileError(
            "structured_outputs.json",
            f"at {path}: {why} (unsupported by xgrammar)"
        )

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
    _check_satisfiable(node, path)

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


# (lower bound, upper bound) keyword pairs whose crossing leaves no valid value.
_BOUND_PAIRS = (
    ("minLength", "maxLength"),
    ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_satisfiable(node: dict[str, Any], path: str) -> None:
    """Raises ValueError when no value can match the schema `node`.

    xgrammar compiles some of these into a grammar that still produces output: an empty
    `anyOf` becomes the empty string (an output of "" with finish reason stop, or invalid JSON
    when nested), and a required property that the schema forbids is silently dropped.
    A nested `anyOf: []` is rejected even under an optional property for the same reason.
    """

    def empty(why: str) -> ValueError:
        return GrammarCompileError(
            "structured_outputs.json",
            f"at {path}: {why}, so no value can match"
        )

    for key in ("anyOf", "oneOf", "enum", "type"):
        if isinstance(node.get(key), list) and not node[key]:
            raise empty(f"{key!r} is an empty list")
    for low, high in _BOUND_PAIRS:
        lo, hi = node.get(low), node.get(high)
        if _is_number(lo) and _is_number(hi) and lo > hi:
            raise empty(f"{low} ({lo}) is greater than {high} ({hi})")
    _check_numeric_range(node, empty)
    required = node.get("required")
    if not isinstance(required, list):
        return
    names = [r for r in dict.fromkeys(required) if isinstance(r, str)]
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for name in names:
        if props.get(name) is False:
            raise empty(f"required property {name!r} has the schema false")
    max_props = node.get("maxProperties")
    if _is_number(max_props) and len(names) > max_props:
        raise empty(f"{len(names)} properties are required but maxProperties is {max_props}")
    if node.get("additionalProperties") is not False:
        return
    patterns = node.get("patternProperties")
    patterns = list(patterns) if isinstance(patterns, dict) else []
    for name in names:
        if name not in props and not _matches_any(patterns, name):
            raise empty(
                f"required property {name!r} is not in 'properties' (nor matched by "
                "'patternProperties') and additional properties are not allowed"
            )


def _check_numeric_range(node: dict[str, Any], empty: Any) -> None:
    """Raises `empty(...)` when minimum/maximum (inclusive or exclusive) leave no number."""
    lows = [(v, False) for v in [node.get("minimum")] if _is_number(v)]
    lows += [(v, True) for v in [node.get("exclusiveMinimum")] if _is_number(v)]
    highs = [(v, False) for v in [node.get("maximum")] if _is_number(v)]
    highs += [(v, True) for v in [node.get("exclusiveMaximum")] if _is_number(v)]
    if not lows or not highs:
        return
    # The tightest bound of each side; at equal values the exclusive one is tighter.
    lo, lo_ex = max(lows, key=lambda b: (b[0], b[1]))
    hi, hi_ex = min(highs, key=lambda b: (b[0], not b[1]))
    if lo > hi or (lo == hi and (lo_ex or hi_ex)):
        raise empty(f"the bounds leave no number between {lo} and {hi}")
    if node.get("type") == "integer":
        first = math.floor(lo) + 1 if lo_ex or lo != math.floor(lo) else lo
        last = math.ceil(hi) - 1 if hi_ex or hi != math.ceil(hi) else hi
        if first > last:
            raise empty(f"no integer lies between {lo} and {hi}")


def _matches_any(patterns: list[str], name: str) -> bool:
    """True when a patternProperties regex may match `name` (also when one cannot be parsed
    here: only a certain mismatch may reject the schema)."""
    for pattern in patterns:
        try:
            if re.search(pattern, name):
                return True
        except (re.error, RecursionError, OverflowError):
            return True
    return False


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
    info, masked, _ = _build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
    return info, masked


def _build_tokenizer_info(
    tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
) -> tuple[xgr.TokenizerInfo, frozenset[int], list[str]]:
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
    return info, masked, encoded


# UTF-8 lead bytes after which only part of the continuation range may follow (RFC 3629):
# E0 needs A0..BF (else overlong), ED 80..9F (else a surrogate), F0 90..BF (else overlong),
# F4 80..8F (else past U+10FFFF). Index = the guard state; 0 = no restriction.
_RESTRICTED_LEADS = (0xE0, 0xED, 0xF0, 0xF4)
_FORBIDDEN_NEXT = ((0x80, 0x9F), (0xA0, 0xBF), (0x80, 0x8F), (0x90, 0xBF))


class Utf8Guard:
    """Keeps outputs valid UTF-8 where xgrammar 0.2.9 accepts invalid byte sequences.

    The state after a token is the index (1-4) of `_RESTRICTED_LEADS` when the token's last
    byte is one of those lead bytes, else 0; `allowed[state]` is a bitmask row that clears
    the tokens whose first byte may not follow that lead. A restricted pair inside one token
    is not guarded: BPE vocabularies learnt from valid text hold none.
    """

    def __init__(self, first_bytes: np.ndarray, last_bytes: np.ndarray) -> None:
        vocab_size = len(first_bytes)
        self.state_after = np.zeros(vocab_size, dtype=np.int8)
        self.forbidden: list[np.ndarray] = [np.zeros(vocab_size, dtype=bool)]
        words = (vocab_size + 31) // 32
        self.allowed = np.full((len(_RESTRICTED_LEADS) + 1, words), -1, dtype=np.int32)
        for state, (lead, (lo, hi)) in enumerate(zip(_RESTRICTED_LEADS, _FORBIDDEN_NEXT), 1):
            self.state_after[last_bytes == lead] = state
            forbidden = (first_bytes >= lo) & (first_bytes <= hi)
            self.forbidden.append(forbidden)
            bits = np.zeros(words * 32, dtype=np.uint8)
            bits[:vocab_size] = ~forbidden
            self.allowed[state] = np.packbits(bits, bitorder="little").view(np.int32)

    @classmethod
    def from_vocab(cls, info: xgr.TokenizerInfo, encoded: list[str]) -> Utf8Guard:
        """Builds the guard from xgrammar's vocabulary view (`encoded`: the HF token strings,
        "" for masked ids)."""
        n = len(encoded)
        first = np.zeros(n, dtype=np.uint8)
        last = np.zeros(n, dtype=np.uint8)
        if info.vocab_type == xgr.VocabType.BYTE_LEVEL:
            # Each character of a byte-level token stands for one byte: reading just the ends
            # takes a fraction of the second that decoding the whole vocabulary does.
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            to_byte = {c: b for b, c in bytes_to_unicode().items()}
            for i, token in enumerate(encoded):
                if token:
                    first[i] = to_byte.get(token[0], ord(token[0]) & 0xFF)
                    last[i] = to_byte.get(token[-1], ord(token[-1]) & 0xFF)
        else:
            for i, raw in enumerate(info.decoded_vocab[:n]):
                if raw and encoded[i]:
                    first[i], last[i] = raw[0], raw[-1]
        return cls(first, last)


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



# xgrammar's serialized grammar format this module can read (Grammar.serialize_json); its
# expression types, in xgrammar's order.
_KNOWN_GRAMMAR_FORMAT = "v18"
(
    _BYTE_STRING,
    _CHAR_CLASS,
    _CHAR_CLASS_STAR,
    _EMPTY_STR,
    _RULE_REF,
    _SEQUENCE,
    _CHOICES,
    _TAG_DISPATCH,
    _REPEAT,
) = range(9)


def find_stuck_rule(grammar: xgr.Grammar) -> str | None:
    """Returns the name of a rule reachable from the root that can never finish, else None.

    Such a rule derives no finite string (`root ::= root "a"`, or `a ::= b` and `b ::= a`):
    once generation enters it, no token is ever allowed again. Left recursion with a way out
    (`root ::= "b" | root "a"`) is fine. Returns None, checking nothing, when the grammar's
    serialized form is not the one this function knows.
    """
    data = json.loads(grammar.serialize_json())
    if data.get("__VERSION__") != _KNOWN_GRAMMAR_FORMAT:
        return None
    rules = data["rules"]
    flat, starts = data["grammar_expr_data"], data["grammar_expr_indptr"]

    def expr(i: int) -> tuple[int, list[int]]:
        start = starts[i]
        return flat[start], flat[start + 2 : start + 2 + flat[start + 1]]

    # Rules each rule refers to (through its body and its lookahead), for reachability and to
    # revisit a rule when one it uses becomes finishable.
    uses: list[set[int]] = []
    for rule in rules:
        refs: set[int] = set()
        todo = [e for e in (rule[1], rule[2]) if e >= 0]
        while todo:
            kind, args = expr(todo.pop())
            if kind in (_RULE_REF, _REPEAT):
                refs.add(args[0])
            elif kind in (_SEQUENCE, _CHOICES):
                todo.extend(args)
            elif kind == _TAG_DISPATCH:
                refs.update(args[1:-2:2])
            elif kind not in (_BYTE_STRING, _CHAR_CLASS, _CHAR_CLASS_STAR, _EMPTY_STR):
                return None  # an expression type this function does not know
        uses.append(refs)

    finishable: set[int] = set()

    def can_finish(i: int) -> bool:
        kind, args = expr(i)
        if kind == _RULE_REF:
            return args[0] in finishable
        if kind == _REPEAT:
            return args[1] == 0 or args[0] in finishable
        if kind == _SEQUENCE:
            return all(can_finish(a) for a in args)
        if kind == _CHOICES:
            return any(can_finish(a) for a in args)
        return True  # literals, character classes, empty strings, tag dispatch

    # Least fixpoint: a rule can finish once its body can, given the rules known to finish.
    used_by: list[list[int]] = [[] for _ in rules]
    for user, refs in enumerate(uses):
        for ref in refs:
            used_by[ref].append(user)
    todo = list(range(len(rules)))
    while todo:
        r = todo.pop()
        if r not in finishable and can_finish(rules[r][1]):
            finishable.add(r)
            todo.extend(used_by[r])

    root = data["root_rule_id"]
    reachable, todo = {root}, [root]
    while todo:
        for ref in uses[todo.pop()]:
            if ref not in reachable:
                reachable.add(ref)
                todo.append(ref)
    stuck = sorted(r for r in reachable if r not in finishable)
    if not stuck:
        return None
    return rules[root if root in stuck else stuck[0]][0]


@functools.lru_cache(maxsize=256)
def _check_grammar_text(text: str) -> None:
    """Raises ValueError when the EBNF or Lark grammar `text` has a rule that cannot finish.

    Cached: the engine compiles each request's grammar again after the API server did.
    Parse errors are left to the compiler, which reports them.
    """
    lark = "::=" not in text
    try:
        grammar = xgr.Grammar.from_lark(text) if lark else xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError):
        return
    rule = find_stuck_rule(grammar)
    if rule is not None:
        if lark and rule == "root":
            rule = "start"  # xgrammar renames Lark's start rule
        raise GrammarCompileError(
            "structured_outputs.grammar",
            f"rule {rule!r} can never finish (it is left-recursive "
            "or cyclic with no alternative that ends), so generation would get stuck"
        )


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
        *,
        disable_any_whitespace: bool = False,
        max_threads: int | None = None,
        cache_limit_bytes: int = _CACHE_LIMIT_BYTES,
        vocab: PreparedVocab | None = None,
    ) -> None:
        if vocab is None:
            vocab = PreparedVocab.build(tokenizer, vocab_size, stop_token_ids)
        elif vocab.vocab_size != vocab_size:
            raise ValueError(f"vocab_size: {vocab_size} differs from the prepared vocabulary's")
        threads = max_threads if max_threads is not None else helper_threads()
        self.vocab_size = vocab_size
        self.vocab = vocab
        self.disable_any_whitespace = disable_any_whitespace
        self.masked_token_ids = vocab.masked_token_ids
        self.stop_token_ids: tuple[int, ...] = tuple(vocab.info.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(
            vocab.info, max_threads=threads, cache_limit_bytes=cache_limit_bytes
        )
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self._batch_serial = xgr.BatchGrammarMatcher(max_threads=1)

    def compile_grammar(self, params: StructuredOutputsParams) -> XgrammarGrammar:
        """Compiles `params` (cached by content). Raises GrammarCompileError naming the field
        when it does not compile or no output can satisfy it, InvalidRequestError when it is
        malformed."""
        kind = params.kind
        try:
            compiled = self._compile(params, kind)
        except InvalidRequestError:
            raise  # found by our own checks, already naming its field
        except (ValueError, RuntimeError, TypeError) as e:
            # xgrammar's own parse and compile errors: the constraint's fault, named by kind.
            raise GrammarCompileError(f"structured_outputs.{kind}", _clean_error(e)) from e
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
                raise GrammarCompileError(
                    "structured_outputs.regex",
                    f"lookaround {opener!r} is not supported by xgrammar"
                )
            return self.compiler.compile_regex(params.regex)
        if kind == "choice":
            return self.compiler.compile_grammar(choice_to_ebnf(params.choice))
        if kind == "grammar":
            _check_grammar_text(params.grammar)
            if "::=" in params.grammar:
                return self.compiler.compile_grammar(params.grammar)
            return self.compiler.compile_lark(params.grammar)
        if kind == "structural_tag":
            return self.compiler.compile_structural_tag(
                normalize_structural_tag(params.structural_tag)
            )
        raise GrammarCompileError("structured_outputs", f"unknown constraint {kind!r}")

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
        guarded: list[tuple[XgrammarGrammar, int]] = []
        for row, grammar in enumerate(grammars):
            if isinstance(grammar, XgrammarGrammar) and not grammar.is_terminated():
                matchers.append(grammar.matcher)
                rows.append(row)
                if grammar.utf8_state:
                    guarded.append((grammar, row))
            elif grammar is None or grammar.is_terminated():
                bitmask[row] = -1
            else:
                grammar.fill_bitmask(bitmask, row)
        if matchers:
            # Waking helper threads costs more than it saves for small batches (up to
            # milliseconds when the cores are busy).
            batch = self._batch if len(matchers) >= _PARALLEL_FILL_MIN else self._batch_serial
            batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        for grammar, row in guarded:
            grammar.apply_utf8_guard(bitmask, row)

    def destroy(self) -> None:
        """Drops the compiled-grammar cache."""
        self.compiler.clear_cache()
