"""Mistral: each `[TOOL_CALLS]` starts calls in one of the two forms Mistral's tokenizers
write. Up to tokenizer v7: a JSON array of `{"name": ..., "arguments": {...}}` objects. From
v11 (Mistral Small 3.2, Magistral, Devstral): `name[ARGS]{...}`, one `[TOOL_CALLS]` per call
(v13 may put `[CALL_ID]id` before `[ARGS]`). The form is read from the text, so one parser
serves both generations, as upstream's `mistral` does."""

from __future__ import annotations

from enum import Enum
from typing import Any

from vllm.entrypoints.openai.tool_parsers.base import ANY_OBJECT, ToolFormat
from vllm.entrypoints.openai.tool_parsers.calls import CallSink, JsonCallList, ValueEnd, split_at

ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


class _Mode(Enum):
    CONTENT = "content"  # looking for `[TOOL_CALLS]`
    HEAD = "head"  # after it, until the form is known
    ARRAY = "array"  # inside the JSON array (or lone object) of calls
    NAME = "name"  # reading `name` up to `[ARGS]`
    ARGUMENTS = "arguments"  # streaming the object after `[ARGS]`


class MistralFormat(ToolFormat):
    """Text outside the calls is content; the calls go to the sink as they stream."""

    names = ("mistral",)
    start = "[TOOL_CALLS]"

    def __init__(self, functions: dict[str, dict[str, Any]]) -> None:
        super().__init__(functions)
        self._buffer = ""
        self._mode = _Mode.CONTENT
        self._name = ""
        self._calls = JsonCallList()
        self._end = ValueEnd()

    def feed(self, text: str, sink: CallSink) -> str:
        """The content in `text` (plus held-back text now known to be content)."""
        self._buffer += text
        content: list[str] = []
        while self._buffer and self._step(sink, content):
            pass
        return "".join(content)

    def _step(self, sink: CallSink, content: list[str]) -> bool:
        """Consumes what the current mode can from the buffer; False when it needs more."""
        if self._mode is _Mode.CONTENT:
            before, self._buffer, found = split_at(self._buffer, self.start)
            content.append(before)
            if found:
                self._mode = _Mode.HEAD
            return found
        if self._mode is _Mode.HEAD:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            if self._buffer[0] in "[{":
                self._mode, self._calls, self._end = _Mode.ARRAY, JsonCallList(), ValueEnd()
            else:
                self._mode, self._name = _Mode.NAME, ""
            return True
        if self._mode is _Mode.NAME:
            name, self._buffer, found = split_at(self._buffer, ARGS)
            self._name += name
            if found:
                sink.announce(self._name.split(CALL_ID)[0].strip())
                self._mode, self._end = _Mode.ARGUMENTS, ValueEnd()
            return found
        n = self._end.feed(self._buffer)
        piece, self._buffer = self._buffer[:n], self._buffer[n:]
        if self._mode is _Mode.ARRAY:
            self._calls.feed(piece, sink)
        elif piece:
            sink.arguments(piece)
        if self._end.done:
            self._mode = _Mode.CONTENT
        return self._end.done

    def finish(self) -> str | None:
        """A held-back tail that turned out not to start `[TOOL_CALLS]`, or a call whose
        name never reached `[ARGS]` (it is content then)."""
        rest = None
        if self._mode is _Mode.CONTENT and self._buffer:
            rest = self._buffer
        elif self._mode is _Mode.NAME:
            rest = self.start + self._name + self._buffer
        self._buffer, self._mode = "", _Mode.CONTENT
        return rest

    @classmethod
    def strict_tag(
        cls, functions: dict[str, dict[str, Any]], strict: frozenset[str], parallel: bool
    ) -> dict[str, Any]:
        def arguments(name: str) -> dict[str, Any]:
            return functions[name] if name in strict else ANY_OBJECT

        branches = [
            {"type": "object",
             "properties": {"name": {"const": name}, "arguments": arguments(name)},
             "required": ["name", "arguments"], "additionalProperties": False}
            for name in functions
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": (
            branches[0] if len(branches) == 1 else {"anyOf": branches})}
        if not parallel:
            array["maxItems"] = 1
        # Both forms are allowed: which one a checkpoint writes depends on its tokenizer's
        # version, and either reads back to the same calls.
        tags = [{"type": "tag", "begin": cls.start,
                 "content": {"type": "json_schema", "json_schema": array}, "end": ""}]
        tags += [{"type": "tag", "begin": f"{cls.start}{name}{ARGS}",
                  "content": {"type": "json_schema", "json_schema": arguments(name)}, "end": ""}
                 for name in functions]
        return {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": [cls.start], "tags": tags,
            "stop_after_first": not parallel,
        }}
