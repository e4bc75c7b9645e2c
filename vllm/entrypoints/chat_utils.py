"""The server's chat template options (upstream's `--chat-template` and
`--default-chat-template-kwargs`), read and checked once at startup."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Characters a template holds and a file path does not (as upstream decides between them).
_TEMPLATE_MARKS = ("{", "}", "\n")


def load_chat_template(value: str | None) -> str | None:
    """The chat template `--chat-template` names: a file's text, or `value` itself when it is
    an inline template. None when not given.

    Raises ValueError naming the flag when `value` looks like a path (no braces, no newline)
    but is no readable file, or when the template does not parse as Jinja.
    """
    if value is None:
        return None
    path = Path(value).expanduser()
    template: str | None = None
    try:
        if path.is_file():
            template = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template: cannot read {value!r}: {e}") from None
    except ValueError:  # a template too long or odd to be a file name at all
        pass
    if template is None:
        if not any(mark in value for mark in _TEMPLATE_MARKS):
            raise ValueError(f"--chat-template: {value!r} is not a file (nor an inline "
                             "template: it holds no '{', '}' or newline)")
        template = value
    _check_parses(template)
    return template


def _check_parses(template: str) -> None:
    """Raises ValueError naming --chat-template when `template` is not valid Jinja as the
    tokenizer compiles it (its sandbox and extensions)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # an older or newer transformers: plain Jinja's parser
        _compile_jinja_template = None
    try:
        if _compile_jinja_template is not None:
            _compile_jinja_template(template)
        else:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(
                template)
    except Exception as e:  # jinja2.TemplateSyntaxError and the like
        raise ValueError(f"--chat-template: the template does not parse: "
                         f"{type(e).__name__}: {e}") from None


def parse_template_kwargs(text: str | dict[str, Any] | None) -> dict[str, Any]:
    """`--default-chat-template-kwargs` as a dict (a JSON object, e.g.
    '{"enable_thinking": false}'); {} when not given. Raises ValueError naming the flag
    for anything but a JSON object."""
    if text is None:
        return {}
    value = text
    if isinstance(text, str):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--default-chat-template-kwargs: not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--default-chat-template-kwargs: must be a JSON object, e.g. "
                         "'{\"enable_thinking\": false}'")
    return dict(value)
