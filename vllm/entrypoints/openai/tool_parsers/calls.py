"""Tool calls and the JSON readers every format shares: one `{"name", "arguments"}` object
read as it streams, and a run of such objects (a JSON array, or objects separated by `;`)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

# The keys a call's arguments may come under (Llama 3 writes "parameters").
ARGUMENT_KEYS = ("arguments", "parameters")


def new_call_id() -> str:
    """A fresh tool call id, `chatcmpl-tool-...`."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's `tool_calls` entry."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class CallSink(Protocol):
    """Where a reader reports the calls it finds, as they stream."""

    def announce(self, name: str) -> None:
        """A new call of `name` starts (its arguments follow)."""

    def arguments(self, text: str) -> None:
        """More arguments text of the call announced last."""

    def whole(self, call: ToolCall) -> None:
        """A call read whole at its end (it could not be streamed)."""


def call_from_json(text: str) -> ToolCall | None:
    """The call in `text` when it is one JSON object `{"name": str, "arguments": object}`
    (or "parameters"; absent means no arguments), else None."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    key = next((k for k in ARGUMENT_KEYS if k in data), None)
    arguments = data.get(key, {}) if key else {}
    if not isinstance(arguments, dict):
        return None
    return ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False))


class ValueEnd:
    """Finds where one JSON object or array ends in text that arrives in pieces."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value (all of them until it ends)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class JsonCallReader:
    """Reads one `{"name": ..., "arguments": {...}}` object as it arrives: once the name is
    known it announces the call, then passes on the arguments' text as it is written."""

    _HEADER = re.compile(
        r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
    )

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self._args_at: int | None = None  # where the arguments start in `text`
        self._args = ValueEnd()

    def feed(self, piece: str) -> tuple[str | None, str]:
        """(the name, when it has just become known; new arguments text)."""
        self.text += piece
        announced = None
        if self._args_at is None:
            match = self._HEADER.match(self.text)
            # The arguments must start (with an object) before the header is taken as whole.
            if match is None or match.end() == len(self.text):
                return None, ""
            if self.text[match.end()] != "{":
                self._args_at = -1  # not an object: the call is read whole at its end
                return None, ""
            try:
                self.name = json.loads(f'"{match.group(1)}"')
            except json.JSONDecodeError:
                self._args_at = -1
                return None, ""
            announced = self.name
            self._args_at = match.end()
            piece = self.text[self._args_at:]
        if self._args_at < 0 or self._args.done:
            return announced, ""
        return announced, piece[: self._args.feed(piece)]

    @property
    def streaming(self) -> bool:
        """True once the call was announced (its deltas are out)."""
        return self.name is not None

    def close(self, sink: CallSink) -> bool:
        """Ends the object: a call not yet streamed is read whole. False when the object is
        no call at all."""
        if self.streaming:
            return True
        call = call_from_json(self.text)
        if call is None:
            return False
        sink.whole(call)
        return True


class JsonCallList:
    """Reads call objects one after another, skipping the `separators` between them (a JSON
    array's brackets and commas, or Llama's `;`)."""

    def __init__(self, separators: str = " \t\r\n[,]") -> None:
        self.separators = separators
        self._buffer = ""
        self._reader: JsonCallReader | None = None
        self._element: ValueEnd | None = None

    def feed(self, text: str, sink: CallSink) -> None:
        """Reports the calls `text` completes or continues."""
        self._buffer += text
        while self._buffer:
            if self._reader is None:
                self._buffer = self._buffer.lstrip(self.separators)
                if not self._buffer:
                    break
                self._reader, self._element = JsonCallReader(), ValueEnd()
            assert self._element is not None
            n = self._element.feed(self._buffer)
            piece, self._buffer = self._buffer[:n], self._buffer[n:]
            name, args = self._reader.feed(piece)
            if name is not None:
                sink.announce(name)
            if args:
                sink.arguments(args)
            if not self._element.done:
                break
            reader, self._reader = self._reader, None
            reader.close(sink)


def split_at(text: str, tag: str) -> tuple[str, str, bool]:
    """(the text before `tag`, the rest, whether `tag` was found). Without the tag, the rest
    is the tail that may be its start, to hold back until more text comes."""
    at = text.find(tag)
    if at >= 0:
        return text[:at], text[at + len(tag):], True
    keep = partial_suffix(text, tag)
    return text[: len(text) - keep], text[len(text) - keep:], False


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
