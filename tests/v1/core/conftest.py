"""Fixtures shared by the scheduler tests in this folder: the demo model's config and a
factory of scheduler harnesses driven by fake model outputs (sched_utils.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.v1.core.sched_utils import MakeHarness, demo_model_config, harness_factory
from vllm.config import ModelConfig


@pytest.fixture(scope="module")
def model_config() -> ModelConfig:
    return demo_model_config()


@pytest.fixture
def make(model_config: ModelConfig) -> Iterator[MakeHarness]:
    """Builds sync harnesses; at teardown every request is gone and the KV pool is full.
    Modules that need another default (async, another fake model) override this fixture."""
    with harness_factory(model_config) as factory:
        yield factory
