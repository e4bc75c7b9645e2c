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
  order). Reported by kind, since some narrowings are the engine's documented choice (a
  float with an integral value for `integer`, formats spelled stricter).

The schemas come from a grammar of keyword combinations (`SchemaGen`): every type; bounds
with and without `multipleOf`; string lengths, `pattern` and `format`; arrays with `items`,
tuple items (`prefixItems` or draft-04/07's item lists), `contains`, `uniqueItems` and
counts; objects with `properties`, `required`, `additionalProperties`, `patternProperties`,
`propertyNames` and dependent requirements; `$ref` into definitions; `anyOf`, `oneOf`,
`allOf`, `not`, `if`/`then`/`else`; `enum` and `const`; nesting to depth 4; draft-04,
draft-07 and 2020-12 spellings. `hypothesis-jsonschema` would make the valid instances, but
its 0.23.1 fails on this Hypothesis (6.170: `'many' object has no attribute 'more'`), so
`Witness` makes them, and `jsonschema` labels every instance whatever made it.
"""

from __future__ import annotations

import copy
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import numpy as np

from tests.v1.structured_output.oracle import validate_json
from tests.v1.structured_output.walker import WalkVocab, random_walk
from vllm.exceptions import InvalidRequestError
from vllm.sampling_params import StructuredOutputsParams

DRAFTS = {
    "draft-04": "http://json-schema.org/draft-04/schema#",
    "draft-07": "http://json-schema.org/draft-07/schema#",
    "2020-12": "https://json-schema.org/draft/2020-12/schema",
}
NAMES = ["a", "b", "c", "d"]
# Patterns with a sample each that matches (for the witness) and one that does not.
PATTERNS = {
    "^[a-c]+$": ("abc", "abd"),
    "^a": ("ax", "xa"),
    "b$": ("ab", "ba"),
    "^[0-9]{2,4}$": ("123", "1"),
    "^(ab|c)*$": ("abc", "ac"),
    "x": ("axb", "ab"),
    "^[A-Z][a-z]*$": ("Abc", "abc"),
}
FORMATS = {
    "date": "2024-02-29",
    "time": "12:30:00Z",
    "date-time": "2024-01-02T03:04:05Z",
    "email": "a@b.co",
    "uuid": "12345678-1234-1234-1234-123456789abc",
    "ipv4": "10.0.0.1",
    "ipv6": "::1",
    "hostname": "example.com",
    "uri": "https://example.com/a",
}
SCALARS = [None, True, False, 0, 1, -3, 2.5, "", "a", "bc"]


class SchemaGen:
    """Random schemas of one draft, from a seeded `random.Random`."""

    def __init__(self, rng: random.Random, draft: str) -> None:
        self.rng = rng
        self.draft = draft

    def root(self) -> dict[str, Any]:
        """One schema with its `$schema`, sometimes reaching a definition through `$ref`."""
        rng = self.rng
        schema = self.schema(0)
        if rng.random() < 0.15:
            key = "$defs" if self.draft == "2020-12" else "definitions"
            wrapper = {"type": "object", "properties": {"r": {"$ref": f"#/{key}/d"}},
                       "required": ["r"], key: {"d": schema}}
            if rng.random() < 0.5:
                wrapper["additionalProperties"] = False
            schema = wrapper
        return {"$schema": DRAFTS[self.draft], **schema}

    def schema(self, depth: int) -> dict[str, Any]:
        """A subschema at nesting `depth` (containers and combinators only above depth 3)."""
        kinds = ["integer", "number", "string", "boolean", "null", "enum", "const"]
        if depth < 4:
            kinds += ["array", "object", "object", "anyOf", "oneOf", "allOf", "not", "types"]
            if self.draft != "draft-04":
                kinds.append("if")
        kind = self.rng.choice(kinds)
        return getattr(self, "_" + kind.replace("-", "_"))(depth)

    # ------------------------------------------------------------------ scalars

    def _bounds(self, schema: dict[str, Any], values: list[float]) -> None:
        rng = self.rng
        low = rng.choice(values) if rng.random() < 0.6 else None
        high = rng.choice(values) if rng.random() < 0.6 else None
        if low is not None and high is not None and low > high:
            low, high = high, low
        for bound, name in ((low, "minimum"), (high, "maximum")):
            if bound is None:
                continue
            exclusive = rng.random() < 0.3
            if not exclusive:
                schema[name] = bound
            elif self.draft == "draft-04":
                schema[name] = bound
                schema["exclusiveM" + name[1:]] = True
            else:
                schema["exclusiveM" + name[1:]] = bound

    def _integer(self, depth: int) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "integer"}
        self._bounds(schema, [-10, -1, 0, 1, 5, 12, 100])
        if self.rng.random() < 0.4:
            schema["multipleOf"] = self.rng.choice([2, 3, 5, 12])
        return schema

    def _number(self, depth: int) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "number"}
        self._bounds(schema, [-2.5, -1, 0, 0.5, 1, 3.75, 10])
        if self.rng.random() < 0.3:
            schema["multipleOf"] = self.rng.choice([0.5, 0.25, 2, 0.1])
        return schema

    def _string(self, depth: int) -> dict[str, Any]:
        rng = self.rng
        schema: dict[str, Any] = {"type": "string"}
        if rng.random() < 0.5:
            schema["minLength"] = rng.choice([0, 1, 2, 3])
        if rng.random() < 0.5:
            schema["maxLength"] = schema.get("minLength", 0) + rng.choice([0, 1, 3, 6])
        roll = rng.random()
        if roll < 0.3:
            schema["pattern"] = rng.choice(list(PATTERNS))
        elif roll < 0.5:
            schema["format"] = rng.choice(list(FORMATS))
        return schema

    def _boolean(self, depth: int) -> dict[str, Any]:
        return {"type": "boolean"}

    def _null(self, depth: int) -> dict[str, Any]:
        return {"type": "null"}

    def _enum(self, depth: int) -> dict[str, Any]:
        values = self.rng.sample(SCALARS + [[1, "a"], {"a": 1}], self.rng.randint(1, 4))
        schema: dict[str, Any] = {"enum": values}
        if self.rng.random() < 0.3:
            schema["type"] = self.rng.choice(["string", "integer", "number"])
        return schema

    def _const(self, depth: int) -> dict[str, Any]:
        value = self.rng.choice(SCALARS + [{"a": [1, 2]}, [None]])
        return {"enum": [value]} if self.draft == "draft-04" else {"const": value}

    def _types(self, depth: int) -> dict[str, Any]:
        types = self.rng.sample(["null", "boolean", "integer", "number", "string"], 2)
        return {"type": types}

    # ------------------------------------------------------------------ containers

    def _array(self, depth: int) -> dict[str, Any]:
        rng = self.rng
        schema: dict[str, Any] = {"type": "array"}
        roll = rng.random()
        if roll < 0.55:
            schema["items"] = self.schema(depth + 1)
        elif roll < 0.8:
            prefix = [self.schema(depth + 1) for _ in range(rng.randint(1, 2))]
            closed = rng.random() < 0.5
            if self.draft == "2020-12":
                schema["prefixItems"] = prefix
                if closed:
                    schema["items"] = False
            else:
                schema["items"] = prefix
                if closed:
                    schema["additionalItems"] = False
        if self.draft != "draft-04" and rng.random() < 0.2:
            schema["contains"] = self.schema(depth + 1)
            if self.draft == "2020-12" and rng.random() < 0.5:
                schema["maxContains"] = rng.choice([1, 2])
        if rng.random() < 0.25:
            schema["uniqueItems"] = True
        if rng.random() < 0.4:
            schema["minItems"] = rng.choice([0, 1, 2])
        if rng.random() < 0.4:
            schema["maxItems"] = schema.get("minItems", 0) + rng.choice([0, 1, 3])
        return schema

    def _object(self, depth: int) -> dict[str, Any]:
        rng = self.rng
        names = rng.sample(NAMES, rng.randint(0, 3))
        schema: dict[str, Any] = {"type": "object"}
        if names:
            schema["properties"] = {n: self.schema(depth + 1) for n in names}
        if names and rng.random() < 0.6:
            schema["required"] = rng.sample(names, rng.randint(1, len(names)))
        roll = rng.random()
        if roll < 0.35:
            schema["additionalProperties"] = False
        elif roll < 0.5:
            schema["additionalProperties"] = self.schema(3)
        if rng.random() < 0.15:
            schema["patternProperties"] = {"^x": self.schema(3)}
        if rng.random() < 0.1:
            schema["propertyNames"] = rng.choice([{"maxLength": 1}, {"pattern": "^[a-c]$"}])
        if len(names) >= 2 and rng.random() < 0.15:
            first, second = names[:2]
            if self.draft == "2020-12":
                schema["dependentRequired"] = {first: [second]}
            else:
                schema["dependencies"] = {first: [second]}
        if rng.random() < 0.15:
            schema["minProperties"] = rng.choice([1, 2])
        if rng.random() < 0.1:
            schema["maxProperties"] = rng.choice([1, 2, 3])
        return schema

    # ------------------------------------------------------------------ combinators

    def _branches(self, depth: int) -> list[dict[str, Any]]:
        return [self.schema(depth + 1) for _ in range(self.rng.randint(2, 3))]

    def _anyOf(self, depth: int) -> dict[str, Any]:
        return {"anyOf": self._branches(depth)}

    def _oneOf(self, depth: int) -> dict[str, Any]:
        return {"oneOf": self._branches(depth)}

    def _allOf(self, depth: int) -> dict[str, Any]:
        return {"allOf": self._branches(depth)}

    def _not(self, depth: int) -> dict[str, Any]:
        inner = self.schema(depth + 1)
        base = self.rng.choice([{}, {"type": "integer"}, {"type": "string"}, {"type": "object"}])
        return {**base, "not": inner}

    def _if(self, depth: int) -> dict[str, Any]:
        schema: dict[str, Any] = {"if": self.schema(3), "then": self.schema(3)}
        if self.rng.random() < 0.6:
            schema["else"] = self.schema(3)
        return schema


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


@dataclass
class Finding:
    """One disagreement between a backend's grammar and jsonschema."""

    backend: str
    # "unsound" (accepts what jsonschema refuses), "refused" (refuses what it accepts) or
    # "dead end" (a walk found no allowed token, or a token allowed and then rejected).
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
            tally.instances += 1
            valid_value = is_valid(value, schema)
            accepted = self.accepts(grammar, text)
            if accepted and not valid_value:
                tally.findings.append(Finding(self.name, "unsound", schema, text))
            elif valid_value and not accepted:
                if any(self.accepts(grammar, s) for s in spellings(value)):
                    continue  # the value is accepted, in another spelling of its numbers
                tally.findings.append(Finding(self.name, "refused", schema, text,
                                              refusal_kind(value, schema)))


def spellings(value: Any) -> list[str]:
    """Other compact spellings of `value`: its fractions with trailing zeros to 2-6 digits
    (a backend may write `multipleOf: 0.25` with exactly two), integral floats without
    their `.0`."""
    text = compact(value)
    out = []
    for digits in range(2, 7):
        out.append(re.sub(r"(?<![\w.])(-?\d+)\.(\d+)(?![\d.eE])",
                          lambda m: f"{m[1]}.{m[2].ljust(digits, '0')}", text))
    out.append(re.sub(r"(?<![\w.])(-?\d+)\.0(?![\d.eE])", r"\1", text))
    return [s for s in dict.fromkeys(out) if s != text]


def refusal_kind(value: Any, schema: dict[str, Any]) -> str:
    """Why a valid value may be refused, when the reason is a documented narrowing: a float
    with an integral value (integers are written without a fraction), or a format (spelled
    stricter than its RFC). Empty when none applies."""
    text = compact(value)
    if re.search(r"\d\.0(?![0-9])", text):
        return "integral float"
    if '"format"' in json.dumps(schema):
        return "format"
    if _has_unlisted_key(value, schema):
        return "unlisted property"
    return ""


def _has_unlisted_key(value: Any, schema: Any) -> bool:
    """Whether an object in `value` has a key no `properties` of `schema` lists anywhere
    (xgrammar's strict mode does not generate those)."""
    names: set[str] = set()

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                names.update(node["properties"])
            for child in node.values():
                collect(child)
        elif isinstance(node, list):
            for child in node:
                collect(child)

    def unlisted(node: Any) -> bool:
        if isinstance(node, dict):
            return any(k not in names or unlisted(v) for k, v in node.items())
        if isinstance(node, list):
            return any(unlisted(v) for v in node)
        return False

    collect(schema)
    return unlisted(value)


def schemas(seed: int, count: int) -> list[dict[str, Any]]:
    """`count` generated schemas, the drafts in turn, reproducible from `seed`."""
    rng = random.Random(seed)
    drafts = list(DRAFTS)
    return [SchemaGen(rng, drafts[i % len(drafts)]).root() for i in range(count)]
