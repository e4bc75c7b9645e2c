"""Tool-call formats by --tool-call-parser name. A new format is one module here and one
entry in FORMATS."""

from __future__ import annotations

from vllm.entrypoints.openai.tool_parsers.base import ToolFormat
from vllm.entrypoints.openai.tool_parsers.hermes import HermesFormat
from vllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonFormat
from vllm.entrypoints.openai.tool_parsers.mistral import MistralFormat
from vllm.entrypoints.openai.tool_parsers.qwen3_xml import Qwen3XmlFormat

FORMATS: dict[str, type[ToolFormat]] = {
    name: cls
    for cls in (HermesFormat, Llama3JsonFormat, MistralFormat, Qwen3XmlFormat)
    for name in cls.names
}

__all__ = ["FORMATS", "ToolFormat"]
