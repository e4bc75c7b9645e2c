"""The backend registry: every place that names backends reads it, and a backend added to it
is usable by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from vllm import options
from vllm.config import StructuredOutputsConfig
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.backends import registry
from vllm.v1.structured_output.backends.auto import create_backend
from vllm.v1.structured_output.backends.base import (
    BackendOptions,
    StructuredOutputBackend,
    StructuredOutputGrammar,
)

from tests.v1.structured_output.conftest import EOS_IDS, VOCAB_SIZE
from tests.v1.structured_output.manager_utils import modules_loaded_by


class _AnyGrammar(StructuredOutputGrammar):
    """Allows every token and never terminates."""

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return tokens

    def rollback(self, num_tokens: int) -> None:
        pass

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        bitmask[row] = -1

    def is_terminated(self) -> bool:
        return False

    @property
    def num_processed_tokens(self) -> int:
        return 0


class AnyBackend(StructuredOutputBackend):
    """A backend in one file, as a new one would be: enforces nothing."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
        options: BackendOptions = BackendOptions(),
    ) -> None:
        self.vocab_size = vocab_size

    def compile_grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        return _AnyGrammar()


def test_every_registered_backend_is_a_backend() -> None:
    for name in options.GRAMMAR_BACKENDS:
        assert issubclass(registry.backend_class(name), StructuredOutputBackend)
    assert set(options.GRAMMAR_ALIASES.values()) <= set(options.GRAMMAR_BACKENDS)


def test_names_come_from_the_registry() -> None:
    assert options.grammar_server_choices() == (
        "auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
    assert options.grammar_request_names() == {
        "xgrammar": "xgrammar", "guidance": "guidance", "llguidance": "guidance",
        "outlines": "outlines", "lm-format-enforcer": "lm-format-enforcer"}
    # outlines and lm-format-enforcer add no coverage: auto offers them only when named.
    assert registry.backends_for("auto") == ["xgrammar", "guidance"]
    assert registry.request_only_for("auto") == ["outlines", "lm-format-enforcer"]
    assert registry.backends_for("auto", disable_fallback=True) == ["xgrammar"]
    assert registry.backends_for("guidance") == ["guidance"]
    assert registry.backends_for("outlines") == ["outlines"]
    assert registry.request_only_for("outlines") == []
    with pytest.raises(KeyError):
        registry.backends_for("llguidance")
    with pytest.raises(ValueError, match="is not one of auto, xgrammar, guidance, outlines"):
        StructuredOutputsConfig(backend="bogus")
    assert StructuredOutputsConfig(backend="lm-format-enforcer").backend == "lm-format-enforcer"


def test_one_registry_line_makes_a_backend_usable(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(options.GRAMMAR_BACKENDS, "any", f"{__name__}:AnyBackend")
    config = StructuredOutputsConfig(backend="any")  # the server option accepts it
    backend = create_backend(config, tokenizer, VOCAB_SIZE, EOS_IDS)
    grammar, name, reason = backend.compile_choosing(StructuredOutputsParams(regex="a"))
    assert (name, reason) == ("any", "first_choice")
    bitmask = backend.allocate_token_bitmask(1)
    bitmask[0] = 0
    backend.fill_bitmasks([grammar], bitmask, [0])
    assert (bitmask[0] == -1).all()
    auto = create_backend(StructuredOutputsConfig(), tokenizer, VOCAB_SIZE, EOS_IDS)
    assert [n for n, _ in auto._factories] == ["xgrammar", "guidance", "any"]


def test_reading_names_imports_no_backend() -> None:
    code = (
        "import vllm.config, vllm.options as o, vllm.v1.structured_output.backends.registry as r\n"
        "o.grammar_server_choices(), o.grammar_request_names(), r.backends_for('auto')"
    )
    assert modules_loaded_by(
        code, ["xgrammar", "llguidance", "outlines_core", "lmformatenforcer"]) == []


def test_a_request_only_backend_as_the_server_choice(tokenizer: Any) -> None:
    """`--structured-outputs-config.backend outlines` makes it every request's backend; under
    `auto` it compiles only the requests that name it."""
    from vllm.exceptions import UnsupportedConstraintError

    pinned = create_backend(StructuredOutputsConfig(backend="outlines"), tokenizer, VOCAB_SIZE,
                            EOS_IDS)
    _, name, reason = pinned.compile_choosing(StructuredOutputsParams(choice=["a", "b"]))
    assert (name, reason) == ("outlines", "first_choice")
    with pytest.raises(UnsupportedConstraintError, match="grammar.*outlines"):
        pinned.compile_choosing(StructuredOutputsParams(grammar='root ::= "a"'))
    with pytest.raises(UnsupportedConstraintError, match="'xgrammar' is not enabled"):
        pinned.compile_choosing(StructuredOutputsParams(regex="a", backend="xgrammar"))
    auto = create_backend(StructuredOutputsConfig(), tokenizer, VOCAB_SIZE, EOS_IDS)
    _, name, _ = auto.compile_choosing(StructuredOutputsParams(regex="a", backend="outlines"))
    assert name == "outlines"
    assert set(auto._built) == {"outlines"}  # nothing else was needed
