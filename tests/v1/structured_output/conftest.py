"""Shared fixtures: the demo model's real Qwen tokenizer, one xgrammar backend, and one grammar
manager per test module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm.model_executor.model_loader.demo_model import build_demo_model
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.v1.structured_output.manager import StructuredOutputManager

from .manager_utils import make_config
from .walker import WalkVocab, token_bytes

# The demo model's vocabulary facts (FACTS.md): generation EOS ids and lm-head size.
EOS_IDS = [151645, 151643]
VOCAB_SIZE = 151_936


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    """The demo-tiny model directory (built once, cached)."""
    return build_demo_model("demo-tiny")


@pytest.fixture(scope="session")
def tokenizer(demo_dir: Path) -> Any:
    """The demo model's tokenizer (Qwen's vocabulary)."""
    return get_tokenizer(demo_dir)


@pytest.fixture(scope="module")
def manager(demo_dir: Path, tokenizer: Any) -> StructuredOutputManager:
    """A grammar manager of the demo model (one per test module; shut down after it)."""
    manager = StructuredOutputManager(make_config(demo_dir), tokenizer)
    yield manager
    manager.shutdown()


@pytest.fixture(scope="session")
def backend(tokenizer: Any) -> Any:
    """One xgrammar backend for the demo vocabulary."""
    from vllm.v1.structured_output.backends.xgrammar import XgrammarBackend

    backend = XgrammarBackend(tokenizer, VOCAB_SIZE, EOS_IDS)
    yield backend
    backend.destroy()


@pytest.fixture(scope="session")
def pieces(tokenizer: Any) -> list[bytes]:
    """The raw bytes of every token of the demo vocabulary."""
    return token_bytes(tokenizer)


@pytest.fixture(scope="session")
def walk_vocab(pieces: list[bytes]) -> WalkVocab:
    """Token classes for random walks over the demo vocabulary."""
    return WalkVocab.build(pieces, VOCAB_SIZE, EOS_IDS)


@pytest.fixture(scope="session")
def guidance_backend(tokenizer: Any) -> Any:
    """One llguidance backend for the demo vocabulary."""
    from vllm.v1.structured_output.backends.guidance import GuidanceBackend

    backend = GuidanceBackend(tokenizer, VOCAB_SIZE, EOS_IDS)
    yield backend
    backend.destroy()
