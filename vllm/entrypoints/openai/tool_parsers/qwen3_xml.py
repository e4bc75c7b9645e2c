"""Qwen3-Coder's XML calls: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>
...\n</function>\n</tool_call>`."""

from __future__ import annotations

import json
import re
from typing import Any

from vllm.entrypoints.openai.tool_parsers.base import BlockReader, TaggedBlocks, triggered_calls
from vllm.entrypoints.openai.tool_parsers.calls import CallSink

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_FUNCTION_END = re.compile(r"\s*</function>")


class XmlCallReader:
    """Reads one `<function=...>` body: the call is announced at its opening tag, and each
    parameter is passed on as JSON arguments text once its closing tag arrives (typed by the
    function's schema: a string unless the schema says otherwise and the text parses)."""

    def __init__(self, functions: dict[str, dict[str, Any]]) -> None:
        self.functions = functions
        self.text = ""
        self.name: str | None = None
        self._at = 0  # how far `text` is read
        self._num_parameters = 0
        self._closed = False  # the arguments' closing brace is out

    @property
    def streaming(self) -> bool:
        """True once the call was announced."""
        return self.name is not None

    def feed(self, piece: str) -> tuple[str | None, str]:
        """(the name, when it has just become known; new arguments text)."""
        self.text += piece
        announced = None
        args: list[str] = []
        if self.name is None:
            match = _FUNCTION.match(self.text)
            if match is None:
                return None, ""
            self.name = announced = match.group(1).strip()
            self._at = match.end()
            args.append("{")
        while not self._closed:
            if match := _PARAMETER.match(self.text, self._at):
                key = match.group(1).strip()
                separator = ", " if self._num_parameters else ""
                args.append(f"{separator}{json.dumps(key)}: {self._value(key, match.group(2))}")
                self._num_parameters += 1
                self._at = match.end()
            elif match := _FUNCTION_END.match(self.text, self._at):
                args.append("}")
                self._closed = True
                self._at = match.end()
            else:
                break
        return announced, "".join(args)

    def close(self, sink: CallSink) -> bool:
        """Ends the block: closes the arguments of an announced call; False when the block
        never named a function."""
        if self.name is None:
            return False
        if not self._closed:
            sink.arguments("}")
            self._closed = True
        return True

    def _value(self, key: str, raw: str) -> str:
        """The parameter's value as JSON text."""
        raw = raw.removeprefix("\n").removesuffix("\n")
        schema = self.functions.get(self.name or "", {}).get("properties", {}).get(key, {})
        kinds = schema.get("type") if isinstance(schema, dict) else None
        kinds = [kinds] if isinstance(kinds, str) else (kinds or [])
        if not kinds or "string" in kinds:
            return json.dumps(raw, ensure_ascii=False)
        try:
            return json.dumps(json.loads(raw), ensure_ascii=False)
        except json.JSONDecodeError:
            return json.dumps(raw, ensure_ascii=False)


class Qwen3XmlFormat(TaggedBlocks):
    """Each call is a `<function=NAME>` element of `<parameter=KEY>` elements in a
    `<tool_call>` block; a block that names no function stays content."""

    names = ("qwen3_xml", "qwen3_coder")
    start, end = "<tool_call>", "</tool_call>"

    def new_reader(self) -> BlockReader:
        return XmlCallReader(self.functions)

    @classmethod
    def strict_tag(
        cls, functions: dict[str, dict[str, Any]], strict: frozenset[str], parallel: bool
    ) -> dict[str, Any]:
        return triggered_calls(
            functions, strict, cls.start, lambda name: f"{cls.start}\n<function={name}>\n",
            f"\n</function>\n{cls.end}", stop_after_first=not parallel, style="qwen_xml",
        )
