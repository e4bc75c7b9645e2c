"""The server-wide options AutoBackend applies to every request's constraint."""

from __future__ import annotations

from typing import Any

from vllm.config import StructuredOutputsConfig
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.backends.auto import AutoBackend, create_backend

from tests.v1.structured_output.conftest import EOS_IDS, VOCAB_SIZE

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _accepts(auto: AutoBackend, tokenizer: Any, text: str) -> bool:
    """True when `auto` lets a request for SCHEMA write `text`, then stop."""
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    grammar = auto.compile_grammar(params)
    return grammar.accept_tokens("r", tokenizer.encode(text, add_special_tokens=False)
                                 + [EOS_IDS[0]])


def test_server_disable_additional_properties_closes_every_schema(
    guidance_backend: Any, tokenizer: Any
) -> None:
    # llguidance follows JSON Schema: an object that says nothing of other keys takes them.
    open_auto = AutoBackend(VOCAB_SIZE, [("guidance", lambda: guidance_backend)])
    closed = AutoBackend(VOCAB_SIZE, [("guidance", lambda: guidance_backend)],
                         disable_additional_properties=True)
    assert _accepts(open_auto, tokenizer, '{"a":1,"b":2}')
    assert not _accepts(closed, tokenizer, '{"a":1,"b":2}')
    assert _accepts(closed, tokenizer, '{"a":1}')


def test_create_backend_takes_the_option_from_the_config(tokenizer: Any) -> None:
    for value in (False, True):
        config = StructuredOutputsConfig(disable_additional_properties=value)
        # Built lazily: nothing is compiled or loaded here.
        auto = create_backend(config, tokenizer, VOCAB_SIZE, EOS_IDS)
        assert auto._disable_additional_properties is value
