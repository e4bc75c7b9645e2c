"""Hermes (Qwen 2.5 / Qwen 3): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`."""

from __future__ import annotations

import json
from typing import Any

from vllm.entrypoints.openai.tool_parsers.base import BlockReader, TaggedBlocks, triggered_calls
from vllm.entrypoints.openai.tool_parsers.calls import JsonCallReader


class HermesFormat(TaggedBlocks):
    """Each call is one JSON object in a `<tool_call>` block; a block that holds no call
    stays content."""

    names = ("hermes",)
    start, end = "<tool_call>", "</tool_call>"

    def new_reader(self) -> BlockReader:
        return JsonCallReader()

    @classmethod
    def strict_tag(
        cls, functions: dict[str, dict[str, Any]], strict: frozenset[str], parallel: bool
    ) -> dict[str, Any]:
        # parallel_tool_calls false: the reply ends after its one call.
        return triggered_calls(
            functions, strict, cls.start,
            lambda name: f'{cls.start}\n{{"name": {json.dumps(name)}, "arguments": ',
            f"}}\n{cls.end}", stop_after_first=not parallel,
        )
