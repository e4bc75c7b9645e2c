"""Per-request generation parameters and the checks of their values alone (the rules that
need the model, such as vocabulary bounds, are in vllm/v1/engine/validation.py)."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, fields
from typing import Any

import msgspec
import numpy as np

from vllm.exceptions import InvalidRequestError
from vllm.options import GRAMMAR_BACKENDS, grammar_request_names, parse_request_fast_forward

# Bounds on list sizes a request may carry (each entry costs work on every generated token).
MAX_LOGPROBS = 20
MAX_STOP_SEQUENCES = 64
MAX_STOP_LENGTH = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_BAD_WORDS = 128
# OpenAI's range for a logit bias; ±100 bans or forces a token.
LOGIT_BIAS_LIMIT = 100.0

# How the engine stores every numeric field (its runner keeps them in int32, int64 and
# float32 columns): the one table both SamplingParams and the engine core's admission check
# (check_numeric_fields) go by. Integer field -> (dtype, smallest, largest value).
INT_FIELD_BOUNDS: dict[str, tuple[str, int, int]] = {
    **{
        name: ("int32", -(2**31), 2**31 - 1)
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs",
                     "thinking_token_budget")
    },
    "seed": ("int64", -(2**63), 2**63 - 1),
}
FLOAT32_FIELDS = (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"
)
# Integer fields that may be None (unset).
_OPTIONAL_INT_FIELDS = frozenset({"seed", "max_tokens", "logprobs", "thinking_token_budget"})
_FLOAT32_MAX = 3.4028234663852886e38


def _is_int(value: object, low: int, high: int) -> bool:
    """True for an integer (Python or numpy, not a bool) in [low, high]."""
    return (
        isinstance(value, (int, np.integer))
        and not isinstance(value, bool)
        and low <= value <= high
    )


def check_numeric_fields(params: Any) -> None:
    """Raises InvalidRequestError naming the first numeric field of `params` (a
    SamplingParams, possibly changed after it was built) that the engine could not store: an
    integer outside its column's range, or a number that is not a finite float32."""
    for name, (dtype, low, high) in INT_FIELD_BOUNDS.items():
        value = getattr(params, name)
        if value is None and name in _OPTIONAL_INT_FIELDS:
            continue
        if not _is_int(value, low, high):
            raise InvalidRequestError(
                name, f"must be an integer in the {dtype} range, got {value!r}"
            )
    for name in FLOAT32_FIELDS:
        value = getattr(params, name)
        if (
            not isinstance(value, (int, float, np.integer, np.floating))
            or isinstance(value, bool)
            # Compared before isfinite, which cannot convert a huge int to a float.
            or abs(value) > _FLOAT32_MAX
            or not math.isfinite(value)
        ):
            raise InvalidRequestError(name, f"must be a finite float32 number, got {value!r}")


def _backend_name(name: Any) -> str | None:
    """A request's backend name made canonical (None for the server's choice)."""
    if name is None or name == "auto":
        return None
    names = grammar_request_names()
    if name in names:
        return names[name]
    raise InvalidRequestError(
        "structured_outputs.backend",
        f"{name!r} is not a backend of this engine ({', '.join(GRAMMAR_BACKENDS)} or auto)",
    )


def _int_keys(bias: Any) -> Any:
    """logit_bias with decimal-string keys ("50256", as JSON sends them) made ints; anything
    else is left for validation to name."""
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias", "must be an object of token id -> bias")
    out = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)
        out[key] = value
    return out


def _repetition_params(options: dict[str, Any]) -> RepetitionDetectionParams:
    """repetition_detection given as a dict; an unknown key is refused by name."""
    known = {f.name for f in fields(RepetitionDetectionParams)}
    unknown = sorted(str(k) for k in options if k not in known)
    if unknown:
        raise InvalidRequestError(
            f"repetition_detection.{unknown[0]}",
            f"unknown field; known: {', '.join(sorted(known))}",
        )
    return RepetitionDetectionParams(**options)


def _is_unicode(text: str) -> bool:
    """False when `text` holds a lone surrogate (it cannot be encoded as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# Why a StructuredOutputsParams (or the API's structured_outputs) without a constraint fails.
NO_CONSTRAINT_MESSAGE = (
    "exactly one of json, json_object, regex, choice, grammar, structural_tag must be set, "
    "got none"
)


# Largest max_whitespace a request or the server may set: more is as good as unbounded.
MAX_WHITESPACE_LIMIT = 1024


@dataclass
class StructuredOutputsParams:
    """One output constraint. Exactly one of the constraint fields must be set."""

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    # JSON only: a regex for each run of whitespace between JSON tokens (llguidance only, so
    # the `auto` backend picks it), or the most whitespace characters in one run (both
    # backends; None: the server's `max_whitespace`).
    whitespace_pattern: str | None = None
    max_whitespace: int | None = None
    # The backend that must enforce this constraint ("xgrammar" or "guidance"; None or
    # "auto": the server's choice). Upstream's per-request `guided_decoding_backend`.
    backend: str | None = None
    # Grammar fast-forward for this request: "off", "exact" or "canonical" (true/false: exact
    # /off); None: the server's --structured-outputs-config.fast_forward, which is also the
    # most a request may ask for (vllm/v1/structured_output/fast_forward.py).
    fast_forward: str | None = None

    _CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")

    def __post_init__(self) -> None:
        set_ = [name for name in self._CONSTRAINTS if getattr(self, name) not in (None, False)]
        if not set_:
            raise InvalidRequestError("structured_outputs", NO_CONSTRAINT_MESSAGE)
        if len(set_) > 1:
            raise InvalidRequestError(
                "structured_outputs",
                f"exactly one constraint may be set, got {', '.join(set_)}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequestError(
                "structured_outputs.json",
                "must be a JSON schema (dict or string)"
            )
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except json.JSONDecodeError as e:
                raise InvalidRequestError("structured_outputs.json", f"not valid JSON: {e}") from e
        if self.choice is not None:
            if (
                not isinstance(self.choice, list)
                or not self.choice
                or not all(isinstance(c, str) for c in self.choice)
            ):
                raise InvalidRequestError(
                    "structured_outputs.choice",
                    "must be a non-empty list of strings"
                )
        if self.max_whitespace is not None and not _is_int(
            self.max_whitespace, 0, MAX_WHITESPACE_LIMIT
        ):
            raise InvalidRequestError(
                "structured_outputs.max_whitespace",
                f"must be an integer in [0, {MAX_WHITESPACE_LIMIT}], got {self.max_whitespace!r}",
            )
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(
                    f"structured_outputs.{name}",
                    "must be a non-empty string"
                )
        self.backend = _backend_name(self.backend)
        self.fast_forward = parse_request_fast_forward(self.fast_forward)

    @property
    def kind(self) -> str:
        """The name of the constraint that is set."""
        return next(n for n in self._CONSTRAINTS if getattr(self, n) not in (None, False))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Bounds of repetition_detection (upstream vLLM's): the longest pattern looked for, and the
# most repeats a request may ask to see before it stops.
MAX_PATTERN_SIZE = 65536
MAX_MIN_COUNT = 1000


@dataclass
class RepetitionDetectionParams:
    """Stops a request whose output ends in one pattern of `min_pattern_size` to
    `max_pattern_size` tokens repeated `min_count` times in a row (upstream vLLM's fields).

    `max_pattern_size` 0 turns detection off; `min_pattern_size` 0 means 1. The request
    finishes with finish_reason "stop" and stop_reason "repetition_detected"
    (vllm/v1/core/sched/repetition.py). Raises InvalidRequestError naming the field when a
    value is not an integer in its range.
    """

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        def field_error(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"repetition_detection.{name}", why)

        for name, high in (("max_pattern_size", MAX_PATTERN_SIZE),
                           ("min_pattern_size", MAX_PATTERN_SIZE),
                           ("min_count", MAX_MIN_COUNT)):
            value = getattr(self, name)
            if not _is_int(value, 0, high):
                raise field_error(name, f"must be an integer in [0, {high}], got {value!r}")
        if self.min_pattern_size > self.max_pattern_size:
            raise field_error(
                "min_pattern_size",
                f"must be at most max_pattern_size ({self.max_pattern_size}), got "
                f"{self.min_pattern_size}",
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            # One occurrence of a pattern is no repetition: every output would stop at once.
            raise field_error(
                "min_count",
                f"must be at least 2 when max_pattern_size is set, got {self.min_count}",
            )

    @property
    def enabled(self) -> bool:
        """True when detection is on (max_pattern_size above 0)."""
        return self.max_pattern_size > 0


class SamplingParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """How to generate tokens for one request (OpenAI-compatible semantics).

    A msgspec Struct so that it crosses the engine-core boundary as itself: decoding runs
    `__post_init__`, so the engine core gets values already checked by the same rules.
    Decoding forbids unknown fields (a payload with one comes from a broken front end).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Stop a request stuck in a loop (see RepetitionDetectionParams; a dict is accepted).
    repetition_detection: RepetitionDetectionParams | None = None
    # Token id -> bias added to its logit before sampling, in [-100, 100] (keys may be given
    # as decimal strings, as OpenAI's JSON does).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words that must never appear in the output (matched as token sequences).
    bad_words: list[str] | None = None
    # Most tokens the reply may write inside its thinking block before the engine ends it
    # (needs a reasoning parser; None: no limit). See vllm/reasoning/budget.py.
    thinking_token_budget: int | None = None
    # Filled by the engine from the tokenizer (bad_words as token sequences, each as written
    # and with a leading space); crosses the engine-core boundary with the rest.
    bad_words_token_ids: list[list[int]] | None = None
    # Filled by the engine from the model, not by users.
    all_stop_token_ids: set[int] = msgspec.field(default_factory=set)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.repetition_detection, dict):
            self.repetition_detection = _repetition_params(self.repetition_detection)
        if self.logit_bias is not None:
            self.logit_bias = _int_keys(self.logit_bias)
        if self.bad_words is not None and isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.verify()

    def verify(self) -> None:
        """Raises InvalidRequestError naming the first field whose value is out of range.

        Run when the params are built (and decoded); the engine core runs it again on
        what it admits, since code may have changed a field after that."""
        def bad(name: str, why: str) -> InvalidRequestError:
            # The field name travels as an attribute: the server reports it as `param`.
            return InvalidRequestError(name, why)

        # Types and ranges first: every number must fit the engine's int32/int64/float32
        # columns, so no value that passes here can fail later inside the engine core.
        check_numeric_fields(self)

        if self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        if self.temperature < 0.0:
            raise bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be 0 or -1 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens",
                f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        if self.thinking_token_budget is not None and self.thinking_token_budget < 0:
            raise bad("thinking_token_budget",
                      f"must be non-negative, got {self.thinking_token_budget}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not _is_int(self.prompt_logprobs, 0, MAX_LOGPROBS):
            raise bad(
                "prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise bad("stop", f"at most {MAX_STOP_SEQUENCES} sequences, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", "must be non-empty strings")
            if len(s) > MAX_STOP_LENGTH:
                raise bad("stop", f"each sequence is at most {MAX_STOP_LENGTH} characters")
            if not _is_unicode(s):
                raise bad("stop", "must be valid Unicode (no lone surrogates)")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad(
                "stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
            )
        if any(not _is_int(t, 0, 2**31 - 1) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative int32 integers")
        self._verify_token_edits(bad)
        repetition = self.repetition_detection
        if repetition is not None:
            if not isinstance(repetition, RepetitionDetectionParams):
                raise bad("repetition_detection", "must be an object of max_pattern_size, "
                          "min_pattern_size and min_count")
            repetition.__post_init__()  # its values may have changed since it was built

    def _verify_token_edits(self, bad) -> None:
        """Checks logit_bias, allowed_token_ids and bad_words (vocabulary bounds are checked
        by the engine, which knows the vocabulary)."""
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
            for token, value in self.logit_bias.items():
                if not _is_int(token, 0, 2**31 - 1):
                    raise bad("logit_bias", f"keys must be token ids, got {token!r}")
                if (
                    not isinstance(value, (int, float, np.integer, np.floating))
                    or isinstance(value, bool)
                    or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT
                ):
                    raise bad(
                        "logit_bias",
                        f"values must be numbers in [-100, 100], got {value!r} for token {token}",
                    )
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids:
                raise bad("allowed_token_ids", "must be a non-empty list of token ids")
            if any(not _is_int(t, 0, 2**31 - 1) for t in ids):
                raise bad("allowed_token_ids", "must be non-negative int32 integers")
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, list) or len(words) > MAX_BAD_WORDS:
                raise bad("bad_words", f"must be a list of at most {MAX_BAD_WORDS} strings")
            for w in words:
                if not isinstance(w, str) or not w.strip():
                    raise bad("bad_words", "must be non-empty strings")
                if len(w) > MAX_STOP_LENGTH or not _is_unicode(w):
                    raise bad(
                        "bad_words",
                        f"each word is valid Unicode of at most {MAX_STOP_LENGTH} characters",
                    )
        if self.bad_words_token_ids is not None:
            seqs = self.bad_words_token_ids
            if not isinstance(seqs, list) or any(
                not isinstance(q, list) or not q or any(not _is_int(t, 0, 2**31 - 1) for t in q)
                for q in seqs
            ):
                raise bad("bad_words_token_ids", "must be non-empty lists of token ids")

    def clone(self) -> SamplingParams:
        """A deep copy (the engine may fill in fields of its copy without touching this one)."""
        return copy.deepcopy(self)

    @property
    def has_history_bans(self) -> bool:
        """True when a bad word spans several tokens: whether its last token is banned
        depends on the tokens sampled before it."""
        return any(len(q) > 1 for q in self.bad_words_token_ids or ())

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        """True when presence, frequency or repetition penalties change the logits."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def update_from_model(self, eos_token_ids: list[int]) -> None:
        """Records the stop token ids the engine must check (EOS unless ignored, plus user ids)."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(eos_token_ids)
        self.all_stop_token_ids = ids
