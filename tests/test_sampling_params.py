"""SamplingParams rejects every value the engine could not hold, naming the field."""

from __future__ import annotations

import math

import msgspec
import pytest

from vllm.sampling_params import (
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    RepetitionDetectionParams,
    SamplingParams,
)

BAD = [
    # Values that overflowed the runner's int32/int64 columns and killed the engine core.
    ("top_k", 2**31),
    ("top_k", 2**63),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("min_tokens", 2**64),
    ("max_tokens", 2**31),
    ("n", 2**40),
    ("logprobs", 2**64),
    # Non-finite numbers were accepted and sampled garbage.
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", math.nan),
    ("min_p", math.nan),
    ("presence_penalty", math.nan),
    ("frequency_penalty", -math.inf),
    ("repetition_penalty", math.nan),
    ("repetition_penalty", math.inf),
    ("temperature", 1e300),  # finite, but infinite once in the runner's float32 column
    ("presence_penalty", -1e39),
    # Wrong types that Python would otherwise compare happily.
    ("top_k", 2.5),
    ("n", True),
    ("temperature", "hot"),
    ("seed", 1.5),
    ("stop", ["\ud800"]),
    ("stop", ["x" * 5000]),
    ("stop", [str(i) for i in range(MAX_STOP_SEQUENCES + 1)]),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
    ("stop_token_ids", [2**31]),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={str(v)[:20]}" for f, v in BAD])
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(f"{field}: "), str(e.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": 2**31 - 1, "seed": 2**63 - 1, "max_tokens": 2**31 - 1},
        {"seed": -(2**63), "min_tokens": 5, "max_tokens": 5},
        {"temperature": 0, "top_p": 1, "repetition_penalty": 2},
        {"top_k": -1, "stop": "end", "stop_token_ids": [0, 7]},
        {"max_tokens": None, "logprobs": 20},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name == "top_k" and value == -1:
            value = 0
        if name == "stop":
            value = [value]
        assert getattr(params, name) == value


@pytest.mark.parametrize("kwargs, expected", [
    ({}, False),
    ({"presence_penalty": 0.5}, True),
    ({"frequency_penalty": -0.1}, True),
    ({"repetition_penalty": 1.2}, True),
    ({"repetition_penalty": 1.0, "presence_penalty": 0.0}, False),
])
def test_has_penalties(kwargs: dict, expected: bool) -> None:
    assert SamplingParams(**kwargs).has_penalties is expected


@pytest.mark.parametrize("options, field", [
    ({"max_pattern_size": 4, "min_count": 1}, "min_count"),
    ({"max_pattern_size": 4}, "min_count"),
    ({"max_pattern_size": 3, "min_pattern_size": 4, "min_count": 2}, "min_pattern_size"),
    ({"max_pattern_size": -1}, "max_pattern_size"),
    ({"max_pattern_size": 65537, "min_count": 2}, "max_pattern_size"),
    ({"max_pattern_size": 4, "min_count": 1001}, "min_count"),
    ({"max_pattern_size": 2.5, "min_count": 2}, "max_pattern_size"),
    ({"max_pattern_size": True, "min_count": 2}, "max_pattern_size"),
    ({"max_pattern": 4}, "max_pattern"),
])
def test_repetition_detection_ranges_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(repetition_detection=options)
    assert e.value.param == f"repetition_detection.{field}"


def test_repetition_detection_is_checked_again_and_crosses_the_engine_boundary() -> None:
    params = SamplingParams(repetition_detection={"max_pattern_size": 8, "min_count": 3})
    assert isinstance(params.repetition_detection, RepetitionDetectionParams)
    assert params.repetition_detection.enabled
    assert not RepetitionDetectionParams().enabled  # upstream's default: off
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded.repetition_detection == params.repetition_detection
    params.repetition_detection.min_count = 1
    with pytest.raises(ValueError, match="repetition_detection.min_count"):
        params.verify()
