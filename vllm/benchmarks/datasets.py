"""Benchmark requests: random and custom prompts, and structured-output workloads.

Every builder is deterministic for a given seed, so runs that differ only in one setting
(async scheduling, executor, structured ratio) send the same prompts.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vllm.benchmarks.assets import SCHEMA_NAMES, builtin_schema

STRUCTURED_DATASETS = ("json", "json-unique", "grammar", "regex", "choice")
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")

SQL_GRAMMAR = r"""
root ::= "SELECT " columns " FROM " table where? ";"
columns ::= column (", " column){0,3}
column ::= "id" | "username" | "email" | "created_at"
table ::= "users" | "accounts" | "orders"
where ::= " WHERE " column " = " value
value ::= "'" [a-z0-9_]{1,12} "'" | [0-9]{1,6}
""".strip()

EMAIL_REGEX = r"[a-z]{1,12}\.[a-z]{1,12}@[a-z]{1,10}\.(com|org)"

SENTIMENTS = ["positive", "negative", "neutral"]

# Short reviews for the choice workload (varied so prompts are not all one prefix-cache hit).
REVIEWS = (
    "The battery lasts all day and the screen is bright.",
    "It stopped working after a week and support never answered.",
    "Delivery was on time; the box was plain.",
    "Best concert I have been to in years!",
    "The soup was cold and the waiter was rude.",
    "An average film with a few good scenes.",
    "Setup took two minutes and everything just worked.",
    "The manual is confusing and half the parts were missing.",
)


class Tokenizer(Protocol):
    """What the benchmark needs from a tokenizer (a Hugging Face fast tokenizer fits)."""

    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class StructuredSpec:
    """One request's output constraint: kind is json, regex, choice or grammar."""

    kind: str
    # A JSON schema (dict), a regex or EBNF grammar (str), or the choices (list of str).
    value: Any

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"kind: {self.kind!r} is not one of {', '.join(STRUCTURED_KINDS)}")

    def request_fields(self) -> dict[str, Any]:
        """The body fields that ask a vLLM server for this constraint."""
        return {"structured_outputs": {self.kind: self.value}}


@dataclass
class SampleRequest:
    """One benchmark request: its prompt, lengths and optional output constraint."""

    prompt: str
    prompt_len: int
    expected_output_len: int
    structured: StructuredSpec | None = None


def sample_random_requests(
    tokenizer: Tokenizer,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts of random base-vocabulary tokens, lengths drawn from [len*(1-r), len*(1+r)].

    All prompts share `prefix_len` random leading tokens. Raises ValueError for a
    non-positive count or length, or a range ratio outside [0, 1).
    """
    _check_positive("num_prompts", num_requests)
    _check_positive("random_input_len", input_len)
    _check_positive("random_output_len", output_len)
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio: must be in [0, 1), got {range_ratio}")
    if prefix_len < 0:
        raise ValueError(f"random_prefix_len: must be non-negative, got {prefix_len}")
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    requests = []
    for _ in range(num_requests):
        n_in = rng.randint(_low(input_len, range_ratio), _high(input_len, range_ratio))
        n_out = rng.randint(_low(output_len, range_ratio), _high(output_len, range_ratio))
        ids = prefix + [rng.randrange(vocab) for _ in range(n_in)]
        prompt = tokenizer.decode(ids)
        # Decoding and re-encoding can merge tokens; report what the server will see.
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        requests.append(SampleRequest(prompt, prompt_len, n_out))
    return requests


def load_custom_requests(
    path: str | Path,
    tokenizer: Tokenizer,
    num_requests: int,
    output_len: int,
    shuffle: bool = True,
    seed: int = 0,
) -> list[SampleRequest]:
    """Requests from a JSONL file: one object per line with "prompt" (and optionally
    "output_tokens"). Takes the first `num_requests` after an optional seeded shuffle.

    Raises ValueError for a missing file, a malformed line, or too few prompts.
    """
    _check_positive("num_prompts", num_requests)
    _check_positive("custom_output_len", output_len)
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset_path: {str(path)!r} does not exist")
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"dataset_path: {path}:{lineno}: not JSON: {exc}") from exc
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"dataset_path: {path}:{lineno}: needs a string 'prompt' field")
            rows.append(row)
    if len(rows) < num_requests:
        raise ValueError(f"num_prompts: {num_requests} requested but {path} holds {len(rows)}")
    if shuffle:
        random.Random(seed).shuffle(rows)
    requests = []
    for row in rows[:num_requests]:
        n_out = int(row.get("output_tokens", output_len))
        prompt = row["prompt"]
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        requests.append(SampleRequest(prompt, prompt_len, n_out))
    return requests


def load_schema(path: str | Path | None = None) -> dict[str, Any]:
    """A JSON schema from a file, or a shipped schema by name (see `assets.SCHEMA_NAMES`);
    None gives the default shipped schema. A file of that name wins over a shipped schema.

    Raises ValueError if `path` is neither a file nor a shipped name, or the file does not hold
    a JSON object.
    """
    if path is None:
        return builtin_schema()
    path = Path(path)
    if not path.is_file():
        if str(path) in SCHEMA_NAMES:
            return builtin_schema(str(path))
        raise ValueError(
            f"json_schema_path: {str(path)!r} is neither a file nor a shipped schema "
            f"({', '.join(SCHEMA_NAMES)})"
        )
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"json_schema_path: {path} is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema_path: {path} must hold a JSON object")
    return schema


def unique_schema(schema: dict[str, Any], index: int) -> dict[str, Any]:
    """A copy of `schema` with one extra required boolean property named after `index`,
    so every request needs its own grammar compile (no compile-cache hits)."""
    out = copy.deepcopy(schema)
    name = f"flag_{index}"
    out.setdefault("properties", {})[name] = {"type": "boolean"}
    out["required"] = list(out.get("required", [])) + [name]
    return out


def build_structured_requests(
    dataset: str,
    tokenizer: Tokenizer,
    num_requests: int,
    output_len: int,
    structured_ratio: float = 1.0,
    schema: dict[str, Any] | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    """Requests of one structured workload; exactly round(ratio * n) of them, chosen by
    `seed`, carry the constraint, the rest send the same prompt unconstrained.

    Raises ValueError for an unknown dataset, a ratio outside [0, 1] or a non-positive count.
    """
    if dataset not in STRUCTURED_DATASETS:
        raise ValueError(f"dataset: {dataset!r} is not one of {', '.join(STRUCTURED_DATASETS)}")
    if not 0.0 <= structured_ratio <= 1.0:
        raise ValueError(f"structured_output_ratio: must be in [0, 1], got {structured_ratio}")
    _check_positive("num_prompts", num_requests)
    _check_positive("output_len", output_len)
    schema = load_schema() if schema is None and dataset.startswith("json") else schema
    rng = random.Random(seed)
    pairs = [_structured_item(dataset, i, schema, rng) for i in range(num_requests)]
    num_structured = round(structured_ratio * num_requests)
    chosen = set(rng.sample(range(num_requests), num_structured))
    lengths: dict[str, int] = {}
    requests = []
    for i, (prompt, spec) in enumerate(pairs):
        if prompt not in lengths:
            lengths[prompt] = len(tokenizer.encode(prompt, add_special_tokens=False))
        requests.append(
            SampleRequest(prompt, lengths[prompt], output_len, spec if i in chosen else None)
        )
    return requests


def _structured_item(
    dataset: str, index: int, schema: dict[str, Any] | None, rng: random.Random
) -> tuple[str, StructuredSpec]:
    if dataset in ("json", "json-unique"):
        assert schema is not None
        if dataset == "json-unique":
            schema = unique_schema(schema, index)
        prompt = (
            "Generate an example of a user profile that follows this JSON schema: "
            f"{json.dumps(schema, separators=(',', ':'))}"
        )
        return prompt, StructuredSpec("json", schema)
    if dataset == "grammar":
        prompt = "Write an SQL query that lists the username and email of every row in users."
        return prompt, StructuredSpec("grammar", SQL_GRAMMAR)
    if dataset == "regex":
        prompt = (
            "Write the work email address of Ada Lovelace, who works at Analytical. "
            "Answer with the address only, for example ada.lovelace@analytical.com"
        )
        return prompt, StructuredSpec("regex", EMAIL_REGEX)
    review = rng.choice(REVIEWS)
    prompt = f"Classify the sentiment of this review as positive, negative or neutral: {review}"
    return prompt, StructuredSpec("choice", list(SENTIMENTS))


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def _low(length: int, ratio: float) -> int:
    return max(1, int(length * (1.0 - ratio)))


def _high(length: int, ratio: float) -> int:
    return max(1, int(length * (1.0 + ratio)))
