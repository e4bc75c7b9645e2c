"""Size and complexity limits on one request's constraint, checked before any compile.

Pure Python and cheap (one walk over the constraint): the API server runs it without
importing xgrammar, so an oversized constraint is a 400 that costs no compile worker.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from vllm.exceptions import GrammarCompileError
from vllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from vllm.config import StructuredOutputsConfig

__all__ = [
    "SMALL_CONSTRAINT_LENGTH",
    "check_constraint_limits",
    "constraint_key",
    "constraint_length",
]

# Constraints up to this many characters compile in milliseconds (a choice, a short regex, a
# schema of a few properties); they get their own compile lane so that they never wait
# behind big schemas.
SMALL_CONSTRAINT_LENGTH = 4096

_FLAG = "--structured-outputs-config."


def constraint_length(params: StructuredOutputsParams, cap: int | None = None) -> int:
    """The constraint's length in characters: its JSON text (schema, structural tag), regex or
    grammar text, or all choices together; 0 for json_object.

    With `cap`, a dict is measured only until it exceeds `cap` (its strings counted, not its
    JSON punctuation), so that choosing a compile lane for a big schema costs little.
    Raises ValueError when a dict constraint cannot be serialized as JSON.
    """
    kind = params.kind
    if kind == "json_object":
        return 0
    value = getattr(params, kind)
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(len(c) for c in value)
    if cap is not None:
        return _estimate_length(value, cap)
    try:
        return len(json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError) as e:
        raise GrammarCompileError(
            f"structured_outputs.{kind}",
            f"not serializable as JSON: {e}"
        ) from e


def _estimate_length(document: Any, cap: int) -> int:
    total = 0
    stack = [document]
    while stack and total <= cap:
        node = stack.pop()
        if isinstance(node, dict):
            total += 2
            for key, value in node.items():
                total += len(str(key)) + 4
                stack.append(value)
        elif isinstance(node, list):
            total += 2 + len(node)
            stack.extend(node)
        else:
            total += len(str(node))
    return total


def _parse(kind: str, value: str | dict[str, Any]) -> Any:
    """The JSON document of a json or structural_tag constraint (ValueError when invalid)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except RecursionError:
        raise GrammarCompileError(
            f"structured_outputs.{kind}",
            "the JSON nests too deeply"
        ) from None
    except json.JSONDecodeError as e:
        raise GrammarCompileError(f"structured_outputs.{kind}", f"not valid JSON: {e}") from e


def _walk(document: Any) -> tuple[int, int]:
    """Returns (deepest nesting of objects and arrays, number of values of all enum lists).

    Iterative, so a deeply nested document cannot exhaust the Python stack.
    """
    max_depth = 0
    num_enum = 0
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            max_depth = max(max_depth, depth)
            enum = node.get("enum")
            if isinstance(enum, list):
                num_enum += len(enum)
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            max_depth = max(max_depth, depth)
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
    return max_depth, num_enum


def check_constraint_limits(
    params: StructuredOutputsParams, config: StructuredOutputsConfig
) -> int:
    """Checks `params` against the configured limits; returns the constraint's length.

    Raises ValueError naming the field and the option to raise when the constraint is longer
    than `max_constraint_length`, nests deeper than `max_json_depth`, or has more enum values
    or choices than `max_enum_values`; also when a JSON constraint is not valid JSON.
    """
    kind = params.kind
    if kind == "json_object":
        return 0
    value = getattr(params, kind)
    if kind == "choice" and len(value) > config.max_enum_values:
        raise GrammarCompileError(
            "structured_outputs.choice",
            f"{len(value)} options; this server accepts at most "
            f"{config.max_enum_values} ({_FLAG}max_enum_values)"
        )
    if kind in ("json", "structural_tag"):
        if isinstance(value, str):
            # Cheap before parsing: a huge string is refused without reading it.
            _check_length(kind, len(value), config)
        depth, num_enum = _walk(_parse(kind, value))
        if depth > config.max_json_depth:
            raise GrammarCompileError(
                f"structured_outputs.{kind}",
                f"objects and arrays nest {depth} levels deep; this "
                f"server accepts at most {config.max_json_depth} ({_FLAG}max_json_depth)"
            )
        if num_enum > config.max_enum_values:
            raise GrammarCompileError(
                f"structured_outputs.{kind}",
                f"{num_enum} enum values in all; this server accepts "
                f"at most {config.max_enum_values} ({_FLAG}max_enum_values)"
            )
    length = constraint_length(params)
    _check_length(kind, length, config)
    return length


def _check_length(kind: str, length: int, config: StructuredOutputsConfig) -> None:
    if length > config.max_constraint_length:
        raise GrammarCompileError(
            f"structured_outputs.{kind}",
            f"the constraint is {length} characters long; this server "
            f"accepts at most {config.max_constraint_length} ({_FLAG}max_constraint_length)"
        )


def constraint_key(params: StructuredOutputsParams) -> str:
    """A digest that is equal for constraints that compile to the same grammar.

    Dict schemas are serialized with sorted keys, so key order does not matter.
    """
    kind = params.kind
    value = getattr(params, kind)
    if isinstance(value, dict):
        text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    elif isinstance(value, list):
        text = json.dumps(value, ensure_ascii=False)
    else:
        text = str(value)
    options = json.dumps([
        params.disable_any_whitespace, params.disable_additional_properties,
        params.whitespace_pattern, params.max_whitespace, params.backend,
    ])
    head = f"{kind}\0{options}\0"
    return hashlib.sha256((head + text).encode("utf-8", "surrogatepass")).hexdigest()
