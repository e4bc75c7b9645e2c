"""Tests for vllm/entrypoints/openai/serving_models.py: adapters loaded and unloaded by name
while other loads of the same name are still reading their files."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.exceptions import InvalidRequestError


class SlowValidator:
    """Checks an adapter only when the test lets it (as a load reading its files)."""

    def __init__(self) -> None:
        self.reading = threading.Event()
        self.release = threading.Event()
        self.forgotten: list[str] = []

    def check(self, request) -> None:
        self.reading.set()
        assert self.release.wait(30)

    def forget(self, request) -> None:
        self.forgotten.append(request.lora_name)


def test_a_name_being_loaded_is_taken_until_its_load_ends() -> None:
    validator = SlowValidator()
    models = OpenAIServingModels(["base"], "/m", 64, validator)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(models.load_lora_adapter, "a", "/adapters/one")
        assert validator.reading.wait(30)
        # The first load is still reading: the same name cannot start a second one.
        with pytest.raises(InvalidRequestError, match="already"):
            models.load_lora_adapter("a", "/adapters/two")
        assert models.unload_lora_adapter("a") is None  # not served yet
        validator.release.set()
        loaded = first.result(30)
    assert models.lora_requests == {"a": loaded} and loaded.lora_path == "/adapters/one"


def test_a_failed_load_frees_its_name() -> None:
    class Refusing(SlowValidator):
        def check(self, request) -> None:
            raise InvalidRequestError("lora_path", "adapter_config.json: file not found")

    models = OpenAIServingModels(["base"], "/m", 64, Refusing())
    with pytest.raises(InvalidRequestError, match="not found"):
        models.load_lora_adapter("a", "/nowhere")
    validator = SlowValidator()
    validator.release.set()
    models.lora_validator = validator
    assert models.load_lora_adapter("a", "/adapters/one").lora_name == "a"


def test_a_missing_model_is_the_default_and_an_empty_one_is_unknown() -> None:
    models = OpenAIServingModels(["base", "alias"], "/m", 64, None)
    assert models.resolve(None) == "base"
    assert models.resolve("alias") == "alias"
    # An empty name names no model: a 404 like any other unknown name.
    assert models.resolve("") is None
    assert models.resolve("other") is None
