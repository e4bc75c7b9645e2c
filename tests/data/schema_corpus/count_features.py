#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Summarise and sanity-check the JSON schema corpus in this directory.

Usage::

    python tests/data/schema_corpus/count_features.py

Prints, as Markdown tables, the number of entries per file, the draft mix and
how many schemas use each JSON Schema keyword (plus a few derived features
such as ``$ref`` with sibling keywords). Every schema is checked against the
metaschema of the draft named by its ``$schema`` (2020-12 when absent).

Exit status is 1 if any entry is malformed, any name is duplicated or any
schema is invalid for its draft; 0 otherwise. Needs only the standard
library and ``jsonschema``.
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

import jsonschema
import jsonschema.validators

CORPUS_DIR = Path(__file__).resolve().parent
NAME_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")

DRAFT_LABELS = {
    "http://json-schema.org/draft-04/schema#": "draft-04",
    "http://json-schema.org/draft-06/schema#": "draft-06",
    "http://json-schema.org/draft-07/schema#": "draft-07",
    "https://json-schema.org/draft/2019-09/schema": "2019-09",
    "https://json-schema.org/draft/2020-12/schema": "2020-12",
}
OLD_DRAFTS = {"draft-04", "draft-06", "draft-07"}

# Keywords whose value is a single subschema.
SCHEMA_KEYWORDS = (
    "additionalProperties",
    "additionalItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contentSchema",
)
# Keywords whose value is a list of subschemas.
SCHEMA_LIST_KEYWORDS = ("allOf", "anyOf", "oneOf", "prefixItems")
# Keywords whose value maps names to subschemas.
SCHEMA_MAP_KEYWORDS = (
    "properties",
    "patternProperties",
    "definitions",
    "$defs",
    "dependentSchemas",
)
BOUND_KEYWORDS = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
)
LOOKAROUND_RE = re.compile(r"\(\?(=|!|<=|<!)")


def draft_label(schema: dict) -> str:
    uri = schema.get("$schema")
    if uri is None:
        return "none"
    return DRAFT_LABELS.get(uri, uri)


def iter_subschemas(schema, pointer=""):
    """Yield (json_pointer, subschema) for every object schema, depth first."""
    if not isinstance(schema, dict):
        return
    yield pointer, schema
    for key in SCHEMA_KEYWORDS:
        if key in schema:
            yield from iter_subschemas(schema[key], f"{pointer}/{key}")
    items = schema.get("items")
    if isinstance(items, list):
        for i, sub in enumerate(items):
            yield from iter_subschemas(sub, f"{pointer}/items/{i}")
    elif items is not None:
        yield from iter_subschemas(items, f"{pointer}/items")
    for key in SCHEMA_LIST_KEYWORDS:
        value = schema.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                yield from iter_subschemas(sub, f"{pointer}/{key}/{i}")
    for key in SCHEMA_MAP_KEYWORDS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield from iter_subschemas(sub, f"{pointer}/{key}/{name}")
    deps = schema.get("dependencies")
    if isinstance(deps, dict):
        for name, sub in deps.items():
            if isinstance(sub, dict):
                yield from iter_subschemas(sub,
                                           f"{pointer}/dependencies/{name}")


def features_of(schema: dict) -> set[str]:
    """Return the set of keywords and derived features a schema uses."""
    draft = draft_label(schema)
    found: set[str] = set()
    for pointer, sub in iter_subschemas(schema):
        for key, value in sub.items():
            found.add(f"`{key}`")
        ref = sub.get("$ref")
        if isinstance(ref, str):
            if len(sub) > 1:
                era = "draft-04..07" if draft in OLD_DRAFTS else "2019-09+"
                found.add(f"(`$ref` with sibling keywords, {era})")
            target = ref[1:] if ref.startswith("#") else None
            if target and (pointer + "/").startswith(target + "/"):
                found.add("(recursive `$ref`)")
        if isinstance(sub.get("type"), list):
            found.add("(`type` as a list)")
        if isinstance(sub.get("items"), list):
            found.add("(`items` as a tuple array)")
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(sub.get(key), bool):
                found.add(f"(boolean `{key}`, draft-04)")
        multiple = sub.get("multipleOf")
        if isinstance(multiple, (int, float)) and multiple != int(multiple):
            found.add("(non-integer `multipleOf`)")
        for key in BOUND_KEYWORDS:
            bound = sub.get(key)
            if (isinstance(bound, (int, float))
                    and not isinstance(bound, bool)
                    and abs(bound) > 2**31):
                found.add("(bound beyond 32-bit range)")
        pattern = sub.get("pattern")
        if isinstance(pattern, str) and LOOKAROUND_RE.search(pattern):
            found.add("(`pattern` with lookaround)")
        if "pattern" in sub and ("minLength" in sub or "maxLength" in sub):
            found.add("(`pattern` with `minLength`/`maxLength`)")
        fmt = sub.get("format")
        if isinstance(fmt, str):
            found.add(f"(format: {fmt})")
        for key in ("oneOf", "anyOf"):
            branches = sub.get(key)
            if (isinstance(branches, list) and branches and all(
                    isinstance(b, dict) and set(b) == {"required"}
                    for b in branches)):
                found.add(f"(`{key}` of required-only branches)")
            if (isinstance(branches, list) and key == "anyOf" and any(
                    isinstance(b, dict) and b.get("type") == "null"
                    for b in branches)):
                found.add("(nullable via `anyOf` + null)")
        if ("oneOf" in sub or "anyOf" in sub) and ("type" in sub
                                                   or "properties" in sub):
            found.add("(`type`/`properties` beside `oneOf`/`anyOf`)")
    return found


def load_corpus():
    errors: list[str] = []
    entries: list[tuple[str, dict]] = []
    for path in sorted(CORPUS_DIR.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            errors.append(f"{path.name}: not valid JSON: {exc}")
            continue
        if not isinstance(data, list):
            errors.append(f"{path.name}: top level must be a list")
            continue
        for i, entry in enumerate(data):
            where = f"{path.name}[{i}]"
            if not isinstance(entry, dict) or set(entry) != {
                    "name", "source", "schema"}:
                errors.append(
                    f"{where}: expected exactly name/source/schema keys")
                continue
            if not isinstance(entry["name"], str) or not NAME_RE.match(
                    entry["name"]):
                errors.append(f"{where}: bad name {entry['name']!r}")
            if not isinstance(entry["source"], str) or not entry["source"]:
                errors.append(f"{where}: missing source")
            if not isinstance(entry["schema"], dict):
                errors.append(f"{where}: schema must be an object")
                continue
            entries.append((path.name, entry))
    return entries, errors


def check_schemas(entries) -> list[str]:
    errors = []
    seen: dict[str, str] = {}
    for filename, entry in entries:
        name = entry["name"]
        if name in seen:
            errors.append(f"duplicate name {name!r} in {filename} "
                          f"(first in {seen[name]})")
        else:
            seen[name] = filename
        schema = entry["schema"]
        label = draft_label(schema)
        if label not in DRAFT_LABELS.values() and label != "none":
            errors.append(f"{name}: unknown $schema {label!r}")
            continue
        cls = jsonschema.validators.validator_for(
            schema, default=jsonschema.Draft202012Validator)
        try:
            cls.check_schema(schema)
        except jsonschema.exceptions.SchemaError as exc:
            errors.append(f"{name}: invalid for {label}: {exc.message}")
    return errors


def table(header: tuple[str, ...], rows) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> int:
    entries, errors = load_corpus()
    errors += check_schemas(entries)
    total = len(entries)

    per_file = collections.Counter(f for f, _ in entries)
    drafts = collections.Counter(draft_label(e["schema"]) for _, e in entries)
    features = collections.Counter()
    for _, entry in entries:
        features.update(features_of(entry["schema"]))

    def pct(n: int) -> str:
        return f"{100 * n / total:.1f}%" if total else "-"

    print(f"Total schemas: {total}\n")
    print(table(("file", "schemas"), sorted(per_file.items())))
    print()
    print(table(("`$schema` draft", "schemas", "share"),
                ((d, n, pct(n)) for d, n in drafts.most_common())))
    print()
    keyword_rows = sorted(
        ((k, n, pct(n)) for k, n in features.items() if k.startswith("`")),
        key=lambda r: (-r[1], r[0]))
    print(table(("keyword", "schemas using it", "share"), keyword_rows))
    print()
    derived_rows = sorted(
        ((k[1:-1], n, pct(n))
         for k, n in features.items() if k.startswith("(")),
        key=lambda r: (-r[1], r[0]))
    print(table(("derived feature", "schemas using it", "share"),
                derived_rows))

    if errors:
        print(f"\n{len(errors)} problem(s):", file=sys.stderr)
        for err in errors:
            print(f"  - {err}", file=sys.stderr)
        return 1
    print(f"\nAll {total} schemas are valid against their draft's metaschema.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
