"""Llama 3.1+ JSON calls: a reply that starts with `{` (or `<|python_tag|>`) is one or more
`{"name": ..., "parameters": {...}}` objects separated by `;`."""

from __future__ import annotations

import json
from typing import Any

from vllm.entrypoints.openai.tool_parsers.base import ToolFormat, triggered_calls
from vllm.entrypoints.openai.tool_parsers.calls import CallSink, JsonCallList

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonFormat(ToolFormat):
    """The reply is either all calls or all content, decided by how it starts."""

    names = ("llama3_json",)

    def __init__(self, functions: dict[str, dict[str, Any]]) -> None:
        super().__init__(functions)
        self._head = ""  # the reply's start, until it decides
        self._calls: JsonCallList | None = None
        self._content = False

    def feed(self, text: str, sink: CallSink) -> str:
        """The content (the whole reply when it does not start with a call)."""
        if self._content:
            return text
        if self._calls is not None:
            self._calls.feed(text, sink)
            return ""
        self._head += text
        head = self._head.lstrip()
        if not head or PYTHON_TAG.startswith(head):
            return ""  # undecided yet
        if head.startswith(PYTHON_TAG) or head.startswith("{"):
            self._calls = JsonCallList(separators=" \t\r\n;")
            self._calls.feed(head.removeprefix(PYTHON_TAG), sink)
            return ""
        self._content = True
        return self._head

    def finish(self) -> str | None:
        """The start of a reply too short to decide."""
        if self._calls is None and not self._content and self._head:
            return self._head
        return None

    @classmethod
    def strict_tag(
        cls, functions: dict[str, dict[str, Any]], strict: frozenset[str], parallel: bool
    ) -> dict[str, Any]:
        return triggered_calls(
            functions, strict, '{"name": ',
            lambda name: f'{{"name": {json.dumps(name)}, "parameters": ', "}",
            stop_after_first=not parallel,
        )
