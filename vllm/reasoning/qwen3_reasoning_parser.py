"""`--reasoning-parser qwen3`: a reply thinks only when its first token is `<think>`."""

from __future__ import annotations

from vllm.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: `<think> ... </think>` when the reply opens it (its template with
    `enable_thinking: false` writes an empty block into the prompt instead)."""

    always_thinks = False
