"""Size and complexity limits on constraints, their config options and CLI flags."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from vllm.config import StructuredOutputsConfig
from vllm.engine.arg_utils import EngineArgs, merge_dotted_args
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.limits import (
    check_constraint_limits,
    constraint_key,
    constraint_length,
)

SMALL = StructuredOutputsConfig(max_constraint_length=100, max_enum_values=4, max_json_depth=5)


@pytest.mark.parametrize(
    "params,option",
    [
        ({"json": {"type": "string", "description": "x" * 200}}, "max_constraint_length"),
        ({"json": json.dumps({"enum": list(range(30))})}, "max_constraint_length"),
        ({"regex": "a" * 101}, "max_constraint_length"),
        ({"grammar": 'root ::= "' + "a" * 100 + '"'}, "max_constraint_length"),
        ({"choice": ["a" * 60, "b" * 60]}, "max_constraint_length"),
        ({"structural_tag": {"x": "y" * 120}}, "max_constraint_length"),
        ({"choice": ["a", "b", "c", "d", "e"]}, "max_enum_values"),
        ({"json": {"enum": [1, 2, 3, 4, 5]}}, "max_enum_values"),
        # All enums of a schema count together.
        ({"json": {"anyOf": [{"enum": [1, 2, 3]}, {"enum": [4, 5]}]}}, "max_enum_values"),
        ({"json": "[[[[[[1]]]]]]"}, "max_json_depth"),
        ({"json": {"properties": {"a": {"properties": {"b": {"items": {}}}}}}}, "max_json_depth"),
    ],
)
def test_over_a_limit_names_the_field_and_the_option(
    params: dict[str, Any], option: str
) -> None:
    kind = next(iter(params))
    with pytest.raises(ValueError) as info:
        check_constraint_limits(StructuredOutputsParams(**params), SMALL)
    message = str(info.value)
    assert message.startswith(f"structured_outputs.{kind}: "), message
    assert f"--structured-outputs-config.{option}" in message, message


@pytest.mark.parametrize(
    "params",
    [
        {"json": {"type": "object", "properties": {"a": {"enum": [1, 2, 3, 4]}}}},
        {"json": "[[[[1]]]]"},
        {"json_object": True},
        {"choice": ["a", "b", "c", "d"]},
        {"regex": "a" * 100},
        # A property named "enum" is a schema, not an enum list.
        {"json": {"properties": {"enum": {"type": "string"}}}},
    ],
)
def test_within_the_limits(params: dict[str, Any]) -> None:
    check_constraint_limits(StructuredOutputsParams(**params), SMALL)


def test_defaults_accept_real_schemas_and_reject_the_probes() -> None:
    config = StructuredOutputsConfig()
    # A 1,000-property schema (about 30 KB) is fine.
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
    check_constraint_limits(StructuredOutputsParams(json=wide), config)
    # The probes that held the compile threads for minutes are refused before compiling.
    probe = {"enum": [f"value {i}" for i in range(100_000)]}
    with pytest.raises(ValueError, match="100000 enum values"):
        check_constraint_limits(StructuredOutputsParams(json=probe), config)
    with pytest.raises(ValueError, match="max_constraint_length"):
        check_constraint_limits(StructuredOutputsParams(json=json.dumps(probe)), config)
    with pytest.raises(ValueError, match="100000 options"):
        check_constraint_limits(
            StructuredOutputsParams(choice=[str(i) for i in range(100_000)]), config
        )
    # Deeper than Python's own recursion limit: reported, not a RecursionError.
    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ValueError, match="nest 5002 levels deep"):
        check_constraint_limits(StructuredOutputsParams(json={"items": deep}), config)


def test_lengths_and_keys() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}}
    params = StructuredOutputsParams(json=schema)
    assert constraint_length(params) == len(json.dumps(schema))
    assert constraint_length(StructuredOutputsParams(choice=["ab", "c"])) == 3
    assert constraint_length(StructuredOutputsParams(json_object=True)) == 0
    # With a cap, a big dict is measured only until it is known to be bigger.
    big = {"enum": ["x" * 50] * 10_000}
    assert constraint_length(StructuredOutputsParams(json=big), cap=100) > 100
    reordered = StructuredOutputsParams(json=dict(reversed(list(schema.items()))))
    assert constraint_key(params) == constraint_key(reordered)
    for other in (
        StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        StructuredOutputsParams(json=schema, disable_additional_properties=True),
        StructuredOutputsParams(json=json.dumps(schema) + " "),
        StructuredOutputsParams(regex=json.dumps(schema)),
    ):
        assert constraint_key(other) != constraint_key(params)
    # Lone surrogates (valid in JSON text) do not break the digest.
    constraint_key(StructuredOutputsParams(choice=["\ud800"]))


@pytest.mark.parametrize(
    "option,value",
    [
        ("compile_workers", 0),
        ("compile_workers", "2"),
        ("max_constraint_length", -1),
        ("max_enum_values", 1.5),
        ("max_json_depth", True),
        ("compile_timeout_s", 0),
        ("compile_timeout_s", float("nan")),
    ],
)
def test_bad_options_name_the_flag(option: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^--structured-outputs-config\.{option}: "):
        StructuredOutputsConfig(**{option: value})


def test_cli_flags() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    argv = merge_dotted_args([
        "--structured-outputs-config.compile_workers", "3",
        "--structured-outputs-config.max-enum-values=100",
        "--structured-outputs-config.max_constraint_length", "5000",
        "--structured-outputs-config.max_json_depth", "16",
    ])
    args = EngineArgs.from_cli_args(parser.parse_args(argv))
    config = StructuredOutputsConfig(**args.structured_outputs_config)
    assert (config.compile_workers, config.num_compile_workers) == (3, 3)
    assert config.max_enum_values == 100
    assert config.max_constraint_length == 5000
    assert config.max_json_depth == 16
