"""Tests for vllm/v1/core/sched/repetition.py: the detector against a direct restatement of
the rule, and requests that loop stopping through the scheduler's stop checks (sync, async,
with drafts), with fake model outputs."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.v1.core.sched_utils import (
    MakeHarness,
    CYCLE,
    cyclic,
    harness_factory,
    make_request,
)
from vllm.config import ModelConfig
from vllm.sampling_params import RepetitionDetectionParams
from vllm.v1.core.sched.repetition import REPETITION_STOP_REASON, RepetitionDetector


def repeated_tail(tokens: list[int], params: RepetitionDetectionParams) -> int | None:
    """The shortest pattern size in range whose `min_count` copies in a row end `tokens`,
    else None (the rule written out directly, quadratic)."""
    for size in range(max(1, params.min_pattern_size), params.max_pattern_size + 1):
        span = size * params.min_count
        if span > len(tokens):
            return None
        tail = tokens[-span:]
        if all(tail[i] == tail[i % size] for i in range(span)):
            return size
    return None


def test_detector_agrees_with_the_rule_on_random_outputs() -> None:
    rng = random.Random(7)
    detections = 0
    for _ in range(600):
        high = rng.randint(1, 10)
        params = RepetitionDetectionParams(high, rng.randint(0, high), rng.randint(2, 5))
        detector = RepetitionDetector(params)
        tokens: list[int] = []
        vocab = rng.randint(2, 4)
        for _ in range(rng.randint(1, 100)):
            # Half the time copy an earlier token, so repetitions of every size occur.
            back = rng.randint(1, 6)
            copy = rng.random() < 0.5 and back <= len(tokens)
            tokens.append(tokens[-back] if copy else rng.randrange(vocab))
            found = detector.push(tokens[-1])
            assert found == (repeated_tail(tokens, params) is not None), (params, tokens)
            detections += found
    assert detections > 50  # the workload exercises detection, not only its absence
    assert detector.num_tokens == len(tokens)


def test_detector_refuses_params_with_detection_off() -> None:
    with pytest.raises(ValueError):
        RepetitionDetector(RepetitionDetectionParams())


# ---------------------------------------------------------------------- through the scheduler


@pytest.fixture
def make(model_config: ModelConfig) -> Iterator[MakeHarness]:
    """Builds harnesses running the `cyclic` fake model (it repeats CYCLE, 4 tokens)."""
    with harness_factory(model_config, policy=cyclic) as factory:
        yield factory


@pytest.mark.parametrize("config", [
    {}, {"async_scheduling": True}, {"num_speculative_tokens": 3},
    {"async_scheduling": True, "num_speculative_tokens": 3},
], ids=["sync", "async", "drafts", "async-drafts"])
def test_a_looping_request_stops_at_its_third_cycle(make: MakeHarness, config: dict) -> None:
    h = make(**config)
    detect = {"max_pattern_size": 6, "min_pattern_size": 2, "min_count": 3}
    h.add(make_request("loop", CYCLE * 3, max_tokens=40, repetition_detection=detect),
          make_request("free", CYCLE * 3, max_tokens=40),
          # min_tokens holds the stop back, as it holds stop tokens.
          make_request("min", CYCLE * 3, max_tokens=40, min_tokens=14,
                       repetition_detection=detect))
    h.run()
    assert h.tokens["loop"] == CYCLE * 3
    last = h.outputs["loop"][-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", REPETITION_STOP_REASON)
    assert h.finish_reason("free") == "length" and len(h.tokens["free"]) == 40
    assert len(h.tokens["min"]) == 14 and h.outputs["min"][-1].stop_reason == REPETITION_STOP_REASON


def test_a_pattern_longer_than_the_largest_size_is_not_a_repetition(make: MakeHarness) -> None:
    h = make()
    h.add(make_request("loop", CYCLE, max_tokens=20,
                       repetition_detection={"max_pattern_size": 3, "min_count": 2}))
    h.run()
    assert h.finish_reason("loop") == "length" and len(h.tokens["loop"]) == 20
