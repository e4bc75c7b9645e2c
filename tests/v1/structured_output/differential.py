"""Differential checking of the grammar backends against `jsonschema`.

A backend that accepts a constraint must enforce it exactly. For each generated schema, each
backend that accepts it compiles it (compact JSON: no whitespace between tokens), and its
grammar's verdict on instances is compared with `jsonschema`'s (under the schema's own
`$schema` draft, with an exact decimal `multipleOf`, see oracle.py):

- **unsound**: the grammar accepts the text of a value `jsonschema` refuses. The instances
  are the grammar's own outputs (random walks over the tokens it allows), likely-valid values
  made from the schema, and near-misses of those (one keyword broken at a time: a required
  key dropped, a number stepped off its multiple or bound, a string lengthened, a property
  added, an item duplicated). This must never happen.
- **refused**: the grammar refuses the compact text of a value `jsonschema` accepts, written
  with its keys in the schema's `properties` order (the backends generate properties in that
  order), by one of the narrowings the engine declares (closed-world objects and arrays,
  numbers' spelling, formats, `uniqueItems`, `contains`, exclusive `oneOf`): narrowings.py
  proves which one. A refusal no declared narrowing explains is **unexplained**: a finding,
  like an unsound one.
- **dead end**: a random walk reached a state that allows no token (the request would fail,
  never write a wrong output).

The schemas come from `SchemaGen` (schema_gen.py). `hypothesis-jsonschema` would make the
valid instances, but its 0.23.1 fails on this Hypothesis (6.170: `'many' object has no
attribute 'more'`), so `Witness` makes them, and `jsonschema` labels every instance whatever
made it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import numpy as np

from tests.v1.structured_output.narrowings import TOKEN_SPELLING, Explainer
from tests.v1.structured_output.oracle import validate_json
from tests.v1.structured_output.schema_gen import FORMATS, PATTERNS, SCALARS
from tests.v1.structured_output.walker import WalkVocab, random_walk
from vllm.exceptions import InvalidRequestError
from vllm.sampling_params import StructuredOutputsParams

class Witness:
    """Values a schema likely accepts, keys in the schema's `properties` order (jsonschema
    labels them; a wrong guess is only a wasted instance)."""

    def __init__(self, rng: random.Random, root: dict[str, Any]) -> None:
        self.rng = rng
        self.root = root

    def _resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        ref = schema.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return schema
        node: Any = self.root
        for part in ref[2:].split("/"):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        return node if isinstance(node, dict) else {}

    def value(self, schema: Any, depth: int = 0) -> Any:
        """A value for `schema` (a bounded guess past depth 8)."""
        rng = self.rng
        if schema is True or schema == {} or depth > 8:
            return rng.choice(SCALARS)
        if schema is False or not isinstance(schema, dict):
            return None
        schema = self._resolve(schema)
        if "const" in schema:
            return copy.deepcopy(schema["const"])
        if "enum" in schema and schema["enum"]:
            return copy.deepcopy(rng.choice(schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self.value(rng.choice(schema[key]), depth + 1)
        if "allOf" in schema:
            parts = [s for s in schema["allOf"] if isinstance(s, dict)]
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in parts:
                for k, v in part.items():
                    merged.setdefault(k, v)
            return self.value(merged, depth + 1)
        if "if" in schema:
            branch = schema.get("then") if rng.random() < 0.5 else schema.get("else", {})
            rest = {k: v for k, v in schema.items() if k not in ("if", "then", "else")}
            return self.value({**rest, **(branch or {})} if isinstance(branch, dict) else rest,
                              depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = rng.choice(kind) if kind else None
        if kind is None:
            kind = ("object" if "properties" in schema else "array" if "items" in schema
                    else rng.choice(["integer", "string", "null", "boolean"]))
        return getattr(self, "_" + kind, self._null)(schema, depth)

    def _null(self, schema: dict[str, Any], depth: int) -> Any:
        return None

    def _boolean(self, schema: dict[str, Any], depth: int) -> Any:
        return self.rng.random() < 0.5

    def _number_in(self, schema: dict[str, Any], integral: bool) -> float:
        rng = self.rng
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        low = low if isinstance(low, (int, float)) and not isinstance(low, bool) else -20
        high = high if isinstance(high, (int, float)) and not isinstance(high, bool) else low + 40
        step = schema.get("multipleOf", 1 if integral else rng.choice([1, 0.5, 0.25]))
        first, last = int(np.ceil(low / step)), int(np.floor(high / step))
        if first > last:
            return low
        n = rng.randint(first, min(last, first + 50))
        value = n * step
        return int(value) if integral or float(value).is_integer() and rng.random() < 0.7 else value

    def _integer(self, schema: dict[str, Any], depth: int) -> Any:
        return int(self._number_in(schema, True))

    def _number(self, schema: dict[str, Any], depth: int) -> Any:
        return self._number_in(schema, False)

    def _string(self, schema: dict[str, Any], depth: int) -> Any:
        rng = self.rng
        if schema.get("format") in FORMATS:
            return FORMATS[schema["format"]]
        if schema.get("pattern") in PATTERNS:
            return PATTERNS[schema["pattern"]][0]
        low = schema.get("minLength", 0)
        high = schema.get("maxLength", low + 4)
        return "".join(rng.choice("abcxy") for _ in range(rng.randint(low, max(low, high))))

    def _array(self, schema: dict[str, Any], depth: int) -> Any:
        rng = self.rng
        prefix = schema.get("prefixItems")
        items = schema.get("items", {})
        if isinstance(items, list):
            prefix, items = items, schema.get("additionalItems", {})
        out = [self.value(s, depth + 1) for s in (prefix or [])]
        low = schema.get("minItems", 0)
        high = schema.get("maxItems", max(low, len(out)) + 2)
        target = rng.randint(max(low, len(out)), max(low, len(out), high))
        while len(out) < target and items is not False:
            out.append(self.value(items, depth + 1))
        if "contains" in schema and rng.random() < 0.7 and items is not False:
            out.append(self.value(schema["contains"], depth + 1))
        return out

    def _object(self, schema: dict[str, Any], depth: int) -> Any:
        rng = self.rng
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        out = {}
        for name, sub in props.items():
            if name in required or rng.random() < 0.6:
                out[name] = self.value(sub, depth + 1)
        for name in required - set(out):
            out[name] = rng.choice(SCALARS)
        extra = schema.get("additionalProperties", True)
        if extra is not False and rng.random() < 0.2:
            out["z"] = self.value(extra if isinstance(extra, dict) else {}, depth + 1)
        return out


def near_misses(value: Any, schema: dict[str, Any], rng: random.Random) -> list[Any]:
    """Values one edit away from `value`, aimed at the keywords: drop a key, add a property,
    step a number off its multiple or bound, lengthen a string, duplicate an item."""
    out: list[Any] = []

    def edits(node: Any, path: tuple) -> None:
        if isinstance(node, dict):
            for key in node:
                out.append(_without(value, path, key))
            out.append(_with(value, path, "z", 1))
            out.append(_with(value, path, "xq", "a"))
            for key, child in node.items():
                edits(child, path + (key,))
        elif isinstance(node, list):
            if node:
                out.append(_set(value, path, node + [node[0]]))
                out.append(_set(value, path, node[:-1]))
            out.append(_set(value, path, node + [None]))
            for i, child in enumerate(node):
                edits(child, path + (i,))
        elif isinstance(node, bool) or node is None:
            out.append(_set(value, path, 0))
        elif isinstance(node, int):
            for delta in (1, -1, 11, -13):
                out.append(_set(value, path, node + delta))
            out.append(_set(value, path, node + 0.5))
        elif isinstance(node, float):
            for delta in (0.1, -0.25, 1.0):
                out.append(_set(value, path, round(node + delta, 6)))
        elif isinstance(node, str):
            out.append(_set(value, path, node + "a"))
            out.append(_set(value, path, node[:-1]))
            out.append(_set(value, path, node + "Zz9"))
            out.append(_set(value, path, 7))

    edits(value, ())
    rng.shuffle(out)
    return out


def _copy_to(value: Any, path: tuple) -> tuple[Any, Any]:
    root = copy.deepcopy(value)
    node = root
    for step in path:
        node = node[step]
    return root, node


def _set(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    root, parent = _copy_to(value, path[:-1])
    parent[path[-1]] = new
    return root


def _without(value: Any, path: tuple, key: str) -> Any:
    root, node = _copy_to(value, path)
    del node[key]
    return root


def _with(value: Any, path: tuple, key: str, new: Any) -> Any:
    root, node = _copy_to(value, path)
    if key not in node:
        node[key] = new
    return root


def compact(value: Any) -> str:
    """The JSON text a compact grammar generates for `value` (keys in their given order)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# The formats jsonschema checks, and correctly, here: without rfc3339-validator it has no
# `date-time` check and a `time` check that refuses every time ("12:30:00Z" included).
_FORMAT_CHECKER = jsonschema.FormatChecker(formats=[
    f for f, sample in FORMATS.items()
    if f in jsonschema.FormatChecker.checkers and jsonschema.FormatChecker().conforms(sample, f)
])


def is_valid(value: Any, schema: dict[str, Any]) -> bool:
    """`jsonschema`'s verdict under the schema's own draft (exact decimal multipleOf), with
    formats asserted as the engine enforces them."""
    try:
        validate_json(value, schema, format_checker=_FORMAT_CHECKER)
    except jsonschema.ValidationError:
        return False
    except (ArithmeticError, ValueError):
        return False  # a number past float range (1e400 parses as inf): no exact verdict
    return True


def _finite(value: Any) -> bool:
    """Whether every number in `value` is finite."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


@dataclass
class Finding:
    """One disagreement between a backend's grammar and jsonschema."""

    backend: str
    # "unsound" (accepts what jsonschema refuses), "refused" (refuses what it accepts, by a
    # declared narrowing: `detail` names it, see narrowings.py), "unexplained" (refuses what
    # it accepts, by no declared narrowing) or "dead end" (a walk found no allowed token, or
    # a token allowed and then rejected).
    kind: str
    schema: dict[str, Any]
    text: str
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "kind": self.kind, "schema": self.schema,
                "text": self.text, "detail": self.detail}


@dataclass
class Tally:
    """Counts of one backend's run."""

    schemas: int = 0
    accepted: int = 0
    instances: int = 0
    findings: list[Finding] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(f.kind == kind for f in self.findings)


class Checker:
    """Compares one backend's grammars with jsonschema on a tokenizer's vocabulary."""

    def __init__(self, name: str, backend: Any, tokenizer: Any, vocab: WalkVocab,
                 eos_id: int) -> None:
        self.name = name
        self.backend = backend
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.eos_id = eos_id
        self.explainer = Explainer(name, self.format_ok, _FORMAT_CHECKER)
        self._formats: dict[str, Any] = {}

    def accepts_schema(self, params: StructuredOutputsParams, schema: Any, text: str) -> bool:
        """Whether the backend accepts `text` for `params` with `schema` in place of its own
        (False when it refuses that schema)."""
        try:
            grammar = self.backend.compile_grammar(dataclasses.replace(params, json=schema))
        except InvalidRequestError:
            return False
        return self.accepts(grammar, text)

    def format_ok(self, fmt: str, string: str) -> bool:
        """Whether the backend's grammar for `{"type": "string", "format": fmt}` alone
        accepts `string` (True when the backend refuses that schema: nothing to spell)."""
        if fmt not in self._formats:
            params = StructuredOutputsParams(json={"type": "string", "format": fmt},
                                             disable_any_whitespace=True)
            try:
                self._formats[fmt] = self.backend.compile_grammar(params)
            except InvalidRequestError:
                self._formats[fmt] = None
        grammar = self._formats[fmt]
        return grammar is None or self.accepts(grammar, compact(string))

    def accepts(self, grammar: Any, text: str) -> bool:
        """Whether `grammar` accepts `text` as a whole output (then a stop token)."""
        tokens = self.tokenizer.encode(text, add_special_tokens=False) + [self.eos_id]
        return len(grammar.validate_tokens(tokens)) == len(tokens)

    def check(self, schema: dict[str, Any], rng: random.Random, tally: Tally,
              num_instances: int = 24, num_walks: int = 4) -> None:
        """Compiles `schema` (skipped when the backend refuses it) and compares the grammar
        with jsonschema on at least `num_instances` instances; findings go to `tally`."""
        tally.schemas += 1
        params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        try:
            grammar = self.backend.compile_grammar(params)
        except InvalidRequestError:
            return
        tally.accepted += 1
        texts: dict[str, Any] = {}
        walked: dict[str, list[int]] = {}  # a walk's text: its tokens, stop included
        walk_rng = np.random.default_rng(rng.randrange(1 << 30))
        for _ in range(num_walks):
            # A fresh grammar per walk: the engine never rolls a grammar back past its stop.
            walker = self.backend.compile_grammar(params)
            try:
                tokens, stopped = random_walk(walker, self.vocab, walk_rng, max_steps=200)
            except AssertionError as e:
                # A mask that leads nowhere fails the request; it never writes a wrong output.
                tally.findings.append(Finding(self.name, "dead end", schema, "", str(e)[:300]))
                return
            if stopped:
                text = self.tokenizer.decode(tokens[:-1])
                walked[text] = tokens
                try:
                    texts[text] = json.loads(text)
                except json.JSONDecodeError:
                    tally.findings.append(Finding(self.name, "unsound", schema, text,
                                                  "not JSON"))
        witness = Witness(rng, schema)
        valid = [v for v in (witness.value(schema) for _ in range(8)) if is_valid(v, schema)]
        for value in valid:
            texts.setdefault(compact(value), value)
        for value in valid[:3]:
            for miss in near_misses(value, schema, rng)[:num_instances]:
                texts.setdefault(compact(miss), miss)
        for _ in range(4 * num_instances):  # at least num_instances in all, as a rule
            if len(texts) >= num_instances:
                break
            value = witness.value(schema) if rng.random() < 0.5 else rng.choice(SCALARS)
            texts.setdefault(compact(value), value)
            for miss in near_misses(value, schema, rng)[:2]:
                texts.setdefault(compact(miss), miss)
        for text, value in texts.items():
            if not _finite(value):
                continue  # a number past float range (1e400 reads as inf): no exact verdict
            tally.instances += 1
            valid_value = is_valid(value, schema)
            accepted = self.accepts(grammar, text)
            if accepted and not valid_value:
                tally.findings.append(Finding(self.name, "unsound", schema, text))
            elif valid_value and not accepted:
                tokens = walked.get(text)
                if tokens is not None and len(grammar.validate_tokens(tokens)) == len(tokens):
                    why = TOKEN_SPELLING  # the grammar wrote it, in other tokens
                else:
                    why = self.explainer.explain(
                        value, text, schema, lambda t: self.accepts(grammar, t), is_valid,
                        lambda other, t: self.accepts_schema(params, other, t))
                tally.findings.append(Finding(self.name, "refused" if why else "unexplained",
                                              schema, text, why))
