"""Reasoning parsers, as upstream vLLM's `vllm.reasoning` package: the `ReasoningParser` base
class, the `ReasoningParserManager` registry, and the built-in `qwen3` and `deepseek_r1`.

A parser of your own is usable by name once its module is imported:

    from vllm.reasoning import ReasoningParser, ReasoningParserManager

    @ReasoningParserManager.register_module("my_parser")
    class MyParser(ReasoningParser):
        start_token, end_token, always_thinks = "<think>", "</think>", True
"""

from __future__ import annotations

from vllm.reasoning.abs_reasoning_parsers import (
    END,
    PARSERS,
    START,
    ReasoningParser,
    ReasoningParserManager,
    ReasoningState,
    ReasoningStream,
)
from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from vllm.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

__all__ = [
    "END",
    "PARSERS",
    "START",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningParserManager",
    "ReasoningState",
    "ReasoningStream",
]
