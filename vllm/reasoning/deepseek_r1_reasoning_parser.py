"""`--reasoning-parser deepseek_r1`: every reply starts inside its thinking block."""

from __future__ import annotations

from vllm.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: its template opens `<think>` in the prompt, so the reply thinks up to
    `</think>` whether or not it writes `<think>` itself."""

    always_thinks = True
