"""The Responses API's answer built from a finished reply (serving_responses.py), without a
server: the reasoning split and its token count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.reasoning import ReasoningParser

START, END = 5, 6


def _serving() -> OpenAIServingResponses:
    """A Responses server object with a qwen3-like parser (a reply thinks when its first
    token is START) and no tools."""
    serving = OpenAIServingResponses.__new__(OpenAIServingResponses)
    parser = ReasoningParser("test", False, START, END, [1])
    serving.engine = SimpleNamespace(constraint_checker=SimpleNamespace(reasoning_parser=parser))
    serving.tool_plan = lambda request: None
    return serving


@pytest.mark.parametrize("token_ids, text, want", [
    # The answer may write </think> again: the thinking still ends at the first one.
    ([START, 10, 11, END, 12, END, 13], "<think>ab</think>c</think>d", ("ab", "c</think>d", 4)),
    ([START, 10, END, 12], "<think>a</think>c", ("a", "c", 3)),
    ([START, 10, 11], "<think>ab", ("ab", None, 3)),  # cut off while thinking: all of it
    ([12, END, 13], "c</think>d", (None, "c</think>d", 0)),  # never thought
])
def test_reasoning_tokens_run_to_the_first_end_token(token_ids, text, want) -> None:
    reply = CompletionOutput(index=0, text=text, token_ids=token_ids, finish_reason="stop")
    final = RequestOutput("r", None, [1, 9], [reply], finished=True)
    reasoning, content, calls, num_reasoning = _serving()._split(final, reply, request=None)
    assert (reasoning, content, num_reasoning) == want and calls == []
