"""Generated JSON schemas for the differential check (differential.py): `SchemaGen` draws
from a grammar of keyword combinations: every type; bounds with and without `multipleOf`;
string lengths, `pattern` and `format`; arrays with `items`, tuple items (`prefixItems` or
draft-04/07's item lists), `contains`, `uniqueItems` and counts; objects with `properties`,
`required`, `additionalProperties`, `patternProperties`, `propertyNames` and dependent
requirements; `$ref` into definitions; `anyOf`, `oneOf`, `allOf`, `not`,
`if`/`then`/`else`; `enum` and `const`; nesting to depth 4; draft-04, draft-07 and 2020-12
spellings. `PATTERNS` and `FORMATS` carry samples the instance makers use.
"""

from __future__ import annotations

import random
from typing import Any

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


def schemas(seed: int, count: int) -> list[dict[str, Any]]:
    """`count` generated schemas, the drafts in turn, reproducible from `seed`."""
    rng = random.Random(seed)
    drafts = list(DRAFTS)
    return [SchemaGen(rng, drafts[i % len(drafts)]).root() for i in range(count)]
