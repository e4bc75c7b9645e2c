"""Mistral: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}` objects,
to the end of the reply."""

from __future__ import annotations

from typing import Any

from vllm.entrypoints.openai.tool_parsers.base import ANY_OBJECT, ToolFormat
from vllm.entrypoints.openai.tool_parsers.calls import CallSink, JsonCallList, split_at


class MistralFormat(ToolFormat):
    """Text before `[TOOL_CALLS]` is content; everything after it is the array of calls."""

    names = ("mistral",)
    start = "[TOOL_CALLS]"

    def __init__(self, functions: dict[str, dict[str, Any]]) -> None:
        super().__init__(functions)
        self._buffer = ""
        self._calls: JsonCallList | None = None

    def feed(self, text: str, sink: CallSink) -> str:
        """The content before the calls; the calls go to `sink` as they stream."""
        if self._calls is not None:
            self._calls.feed(text, sink)
            return ""
        content, rest, found = split_at(self._buffer + text, self.start)
        if not found:
            self._buffer = rest
            return content
        self._buffer = ""
        self._calls = JsonCallList()
        self._calls.feed(rest, sink)
        return content

    def finish(self) -> str | None:
        """A held-back tail that turned out not to start `[TOOL_CALLS]`."""
        rest, self._buffer = self._buffer or None, ""
        return rest

    @classmethod
    def strict_tag(
        cls, functions: dict[str, dict[str, Any]], strict: frozenset[str], parallel: bool
    ) -> dict[str, Any]:
        branches = [
            {"type": "object",
             "properties": {"name": {"const": name},
                            "arguments": params if name in strict else ANY_OBJECT},
             "required": ["name", "arguments"], "additionalProperties": False}
            for name, params in functions.items()
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": (
            branches[0] if len(branches) == 1 else {"anyOf": branches})}
        if not parallel:
            array["maxItems"] = 1
        tag = {"type": "tag", "begin": cls.start,
               "content": {"type": "json_schema", "json_schema": array}, "end": ""}
        # The calls end the reply, so one array is all there is.
        return {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": [cls.start], "tags": [tag],
            "stop_after_first": True,
        }}
