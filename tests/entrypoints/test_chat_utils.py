"""--chat-template and --default-chat-template-kwargs (vllm/entrypoints/chat_utils.py): a
file or an inline template replaces the model's, checked at startup; the default variables
reach every rendering and a request's chat_template_kwargs override them."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm.entrypoints.chat_utils import load_chat_template, parse_template_kwargs
from vllm.entrypoints.cli.main import main
from vllm.model_executor.model_loader.demo_model import build_demo_model
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.v1.engine.processor import InputProcessor

TEMPLATE = "{{ greeting }}|{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"


def test_a_file_or_an_inline_template(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template(None) is None


@pytest.mark.parametrize(("value", "message"), [
    ("missing/chat.jinja", "--chat-template: 'missing/chat.jinja' is not a file"),
    ("{% for m in messages %}{{ m.content }}", "--chat-template: the template does not parse"),
    ("{{ 1 + }}", "--chat-template: the template does not parse"),
])
def test_a_missing_file_or_a_broken_template_is_refused(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_chat_template(value)


def test_a_broken_template_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "broken.jinja"
    path.write_text("{% if x %}never closed")
    with pytest.raises(ValueError, match="--chat-template: the template does not parse"):
        load_chat_template(str(path))


def test_template_kwargs_must_be_a_json_object() -> None:
    assert parse_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    assert parse_template_kwargs(None) == {}
    for bad in ("[1]", "{nope", '"x"'):
        with pytest.raises(ValueError, match="--default-chat-template-kwargs"):
            parse_template_kwargs(bad)


@pytest.mark.parametrize(("flags", "message"), [
    (["--chat-template", "no/such.jinja"], "--chat-template: 'no/such.jinja' is not a file"),
    (["--chat-template", "{% if %}"], "--chat-template: the template does not parse"),
    (["--default-chat-template-kwargs", "[]"], "--default-chat-template-kwargs: must be"),
])
def test_serve_refuses_them_at_startup(flags, message, capsys) -> None:
    assert main(["serve", "demo-tiny", *flags, "--port", "0"]) == 2
    assert message in capsys.readouterr().err


def test_the_processor_renders_with_the_template_and_its_defaults() -> None:
    processor = InputProcessor.__new__(InputProcessor)  # only the chat template part
    processor.tokenizer = get_tokenizer(str(build_demo_model("demo-tiny")))
    processor.chat_template = TEMPLATE
    processor.default_chat_template_kwargs = {"greeting": "hello"}
    messages = [{"role": "user", "content": "Hi"}]
    assert processor.apply_chat_template(messages) == "hello|user:Hi;"
    assert processor.apply_chat_template(messages, greeting="bye") == "bye|user:Hi;"
    processor.chat_template = None  # the model's own template
    assert "hello|" not in processor.apply_chat_template(messages)
