"""Tests for vllm/entrypoints/openai/serving_models.py: adapters loaded and unloaded by name
while other loads of the same name are still reading their files, and runtime adapter paths
confined to the allowed directories."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm.entrypoints.openai.serving_models import (
    ALLOW_RUNTIME_LORA_UPDATING_ENV,
    LORA_PATH_OUTSIDE_ROOTS,
    OpenAIServingModels,
    confine_lora_path,
    lora_allowed_roots,
    runtime_lora_updating_allowed,
)
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


def test_runtime_paths_resolve_inside_the_allowed_roots(tmp_path) -> None:
    root = tmp_path / "adapters"
    (root / "sql").mkdir(parents=True)
    outside = tmp_path / "secret"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    roots = lora_allowed_roots([str(root / "sql")], [])
    assert roots == [str(root.resolve())]
    # Inside (even spelled with `..` that stays inside): the resolved path.
    assert confine_lora_path(str(root / "sql"), roots) == str((root / "sql").resolve())
    assert confine_lora_path(str(root / "x" / ".." / "sql"), roots) == str(
        (root / "sql").resolve())
    # Out by `..`, by a link inside the root, or a sibling sharing the root's name as a
    # prefix: one message, the same for a path that exists and one that does not.
    messages = set()
    for path in (root / ".." / "secret", root / "link", root / "link" / "missing",
                 tmp_path / "adapters-2", tmp_path / "nowhere", "/etc/passwd", "a\0b"):
        with pytest.raises(InvalidRequestError) as info:
            confine_lora_path(str(path), roots)
        assert info.value.param == "lora_path"
        messages.add(str(info.value))
    assert messages == {f"lora_path: {LORA_PATH_OUTSIDE_ROOTS}"}
    assert str(outside) not in LORA_PATH_OUTSIDE_ROOTS


def test_no_roots_allow_no_runtime_path(tmp_path) -> None:
    with pytest.raises(InvalidRequestError, match="not inside"):
        confine_lora_path(str(tmp_path), [])


def test_an_allowed_dir_must_be_a_directory(tmp_path) -> None:
    (tmp_path / "file").write_text("")
    assert lora_allowed_roots([], [str(tmp_path)]) == [str(tmp_path.resolve())]
    for bad in (tmp_path / "file", tmp_path / "missing"):
        with pytest.raises(ValueError, match="--lora-allowed-dir"):
            lora_allowed_roots([], [str(bad)])


def test_a_runtime_load_is_confined_and_reads_the_resolved_path(tmp_path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    validator = SlowValidator()
    validator.release.set()
    models = OpenAIServingModels(["base"], "/m", 64, validator,
                                 lora_allowed_roots=[str(tmp_path.resolve())])
    loaded = models.load_runtime_lora_adapter("a", str(tmp_path / "alias"))
    assert loaded.lora_path == str((tmp_path / "real").resolve())
    with pytest.raises(InvalidRequestError, match="not inside"):
        models.load_runtime_lora_adapter("b", "/etc")
    assert set(models.lora_requests) == {"a"}
    # A --lora-modules adapter (load_lora_adapter) is the operator's choice: not confined.
    assert models.load_lora_adapter("c", "/adapters/c").lora_path == "/adapters/c"


@pytest.mark.parametrize(("value", "flag", "allowed"), [
    (None, False, False), ("0", False, False), ("", False, False), ("yes", False, False),
    ("1", False, True), ("true", False, True), (" TRUE ", False, True), (None, True, True),
])
def test_the_runtime_switch_is_the_flag_or_the_environment(monkeypatch, value, flag,
                                                           allowed) -> None:
    # Set after import: the variable is read on each call, not once at import.
    if value is None:
        monkeypatch.delenv(ALLOW_RUNTIME_LORA_UPDATING_ENV, raising=False)
    else:
        monkeypatch.setenv(ALLOW_RUNTIME_LORA_UPDATING_ENV, value)
    assert runtime_lora_updating_allowed(flag) is allowed
