"""What a tool-call format is: how one model family writes calls into free text (tool_choice
"auto"), read back as the text streams, and the structural tag that makes strict calls valid."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from vllm.entrypoints.openai.tool_parsers.calls import CallSink, split_at

# The arguments of a function that is not strict: any JSON object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def triggered_calls(
    functions: dict[str, dict[str, Any]],
    strict: frozenset[str],
    trigger: str,
    begin: Callable[[str], str],
    end: str,
    stop_after_first: bool,
    style: str = "json",
) -> dict[str, Any]:
    """A structural tag with one tag per function, `begin(name)` ... `end`, entered when the
    model writes `trigger`: strict functions' bodies follow their schema, the others are any
    JSON object (written in `style`: xgrammar's "json" or e.g. "qwen_xml")."""
    tags = []
    for name, params in functions.items():
        content = {"type": "json_schema", "json_schema": params if name in strict else ANY_OBJECT}
        if style != "json":
            content["style"] = style
        tags.append({"type": "tag", "begin": begin(name), "content": content, "end": end})
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": [trigger], "tags": tags,
        "stop_after_first": stop_after_first,
    }}


class ToolFormat(ABC):
    """Reads one reply's tool calls in one family's format, as the reply streams in.

    `feed` returns the text that is certainly content (not part of a call) and reports calls
    to the sink; `finish` returns what it held back at the end of the reply.
    """

    # The --tool-call-parser names of the format.
    names: ClassVar[tuple[str, ...]]

    def __init__(self, functions: dict[str, dict[str, Any]]) -> None:
        """`functions`: the request's tools, name -> parameters schema."""
        self.functions = functions

    @abstractmethod
    def feed(self, text: str, sink: CallSink) -> str:
        """The content in `text` (plus what was held back and is now known to be content)."""

    @abstractmethod
    def finish(self) -> str | None:
        """Content held back at the end of the reply (e.g. an unclosed call never announced)."""

    @classmethod
    @abstractmethod
    def strict_tag(
        cls, functions: dict[str, dict[str, Any]], strict: frozenset[str], parallel: bool
    ) -> dict[str, Any]:
        """The structural tag (xgrammar's format) that constrains every call's body: strict
        functions by their schema, the others to any JSON object; free text stays free."""


class BlockReader(Protocol):
    """Reads the body of one tagged call block."""

    @property
    def streaming(self) -> bool:
        """True once the call was announced."""

    text: str

    def feed(self, piece: str) -> tuple[str | None, str]:
        """(the name, when it has just become known; new arguments text)."""

    def close(self, sink: CallSink) -> bool:
        """Ends the block; False when the block holds no call (it is content then)."""


class TaggedBlocks(ToolFormat):
    """Calls written between a start and an end tag, anywhere in the reply."""

    start: ClassVar[str]
    end: ClassVar[str]

    def __init__(self, functions: dict[str, dict[str, Any]]) -> None:
        super().__init__(functions)
        self._buffer = ""
        self._reader: BlockReader | None = None

    @abstractmethod
    def new_reader(self) -> BlockReader:
        """A reader for the body of one block."""

    def feed(self, text: str, sink: CallSink) -> str:
        """The content in `text`; calls go to `sink` as their blocks stream."""
        self._buffer += text
        content: list[str] = []
        while self._buffer:
            if self._reader is None:
                before, self._buffer, found = split_at(self._buffer, self.start)
                content.append(before)
                if not found:
                    break
                self._reader = self.new_reader()
                continue
            body, self._buffer, found = split_at(self._buffer, self.end)
            name, args = self._reader.feed(body)
            if name is not None:
                sink.announce(name)
            if args:
                sink.arguments(args)
            if not found:
                break
            reader, self._reader = self._reader, None
            if not reader.close(sink):
                content.append(self.start + reader.text + self.end)
        return "".join(content)

    def finish(self) -> str | None:
        """An unclosed block whose call was never announced, or a held-back tail."""
        reader, rest = self._reader, None
        if reader is not None and not reader.streaming:
            rest = self.start + reader.text + self._buffer
        elif reader is None and self._buffer:
            rest = self._buffer
        self._buffer, self._reader = "", None
        return rest
