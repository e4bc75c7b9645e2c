"""`vllm.reasoning` as upstream's package: the ReasoningParser base class, the
ReasoningParserManager registry, and a parser registered by the user's own module."""

from __future__ import annotations

import json

import pytest

from vllm.reasoning import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningParserManager,
)


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self._vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


VOCAB = {"<think>": 5, "</think>": 6, "<|im_start|>": 1}


def test_builtin_parsers_are_registered_subclasses() -> None:
    assert ReasoningParserManager.get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert ReasoningParserManager.get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    for name in ("qwen3", "deepseek_r1"):
        assert issubclass(ReasoningParserManager.get_reasoning_parser(name), ReasoningParser)
    with pytest.raises(ValueError, match="--reasoning-parser: 'nope'"):
        ReasoningParserManager.get_reasoning_parser("nope")


def test_upstream_methods_split_text_and_ids() -> None:
    qwen = Qwen3ReasoningParser(FakeTokenizer(VOCAB))
    r1 = DeepSeekR1ReasoningParser(FakeTokenizer(VOCAB))
    assert qwen.extract_reasoning_content("<think>hmm</think>yes") == ("hmm", "yes")
    assert qwen.extract_reasoning_content("plain answer") == (None, "plain answer")
    assert r1.extract_reasoning_content("hmm</think>yes") == ("hmm", "yes")
    assert r1.extract_reasoning("still thinking") == ("still thinking", None)
    assert qwen.is_reasoning_end([1, 5, 9, 6]) and not qwen.is_reasoning_end([1, 5, 9])
    assert qwen.extract_content_ids([5, 9, 6, 7, 8]) == [7, 8]
    assert qwen.extract_content_ids([5, 9]) == []
    delta = qwen.extract_reasoning_content_streaming(
        "<think>hm", "<think>hmm</think>ye", "m</think>ye", [5], [5, 9, 6], [9, 6])
    assert (delta.reasoning_content, delta.content) == ("m", "ye")
    assert qwen.extract_reasoning_content_streaming("a", "a", "", [], [], []) is None


def test_extract_reasoning_takes_the_arguments_upstream_passes() -> None:
    qwen = Qwen3ReasoningParser(FakeTokenizer(VOCAB))
    request = object()  # a chat or Responses request: the split does not depend on it
    assert qwen.extract_reasoning_content("<think>a</think>b", request) == ("a", "b")
    assert qwen.extract_reasoning("<think>a</think>b", request=request) == ("a", "b")
    # A prompt that opened the block (DeepSeek-R1's template) makes the reply thinking from
    # its first character; one that closed it, all answer; the text alone says neither.
    opened, closed = [1, 9, 5], [1, 9, 5, 6]
    assert qwen.extract_reasoning_content("a</think>b", request, opened) == ("a", "b")
    assert qwen.extract_reasoning_content("a</think>b", None, prompt_token_ids=closed) == (
        None, "a</think>b")
    assert qwen.extract_reasoning("a</think>b", prompt_token_ids=opened,
                                  model_output_token_ids=[9]) == ("a", "b")
    assert qwen.extract_reasoning_content("<think>a</think>b", request, [1, 9]) == ("a", "b")


def test_a_tokenizer_without_the_markers_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--reasoning-parser qwen3: the tokenizer has no"):
        Qwen3ReasoningParser(FakeTokenizer({"<think>": 5}))


@ReasoningParserManager.register_module("user_think")
class UserThinkParser(ReasoningParser):
    """A parser defined outside the package: every reply starts thinking."""

    always_thinks = True


def test_register_module_decorator_and_force() -> None:
    assert ReasoningParserManager.get_reasoning_parser("user_think") is UserThinkParser
    assert "user_think" in ReasoningParserManager.list_registered()
    with pytest.raises(KeyError):
        ReasoningParserManager.register_module("user_think", force=False)(UserThinkParser)
    with pytest.raises(TypeError):
        ReasoningParserManager.register_module("bad")(object)


def test_a_user_registered_parser_is_usable_by_name_in_the_engine() -> None:
    from vllm import LLM, SamplingParams, StructuredOutputsParams

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    params = SamplingParams(max_tokens=200, temperature=0,
                            structured_outputs=StructuredOutputsParams(json=schema))
    llm = LLM("demo-think", max_model_len=512, max_num_seqs=2, reasoning_parser="user_think")
    try:
        engine_parser = llm.llm_engine.engine_core.structured_output_manager.reasoning_parser
        assert isinstance(engine_parser, UserThinkParser)
        out = llm.chat([{"role": "user", "content": "Answer."}], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    text = out.outputs[0].text
    # The thinking ran free; the constraint applied only after </think>.
    reasoning, content = engine_parser.extract_reasoning_content(text)
    assert reasoning and "OK" in reasoning
    assert out.outputs[0].finish_reason == "stop"
    assert json.loads(content)["ok"] in (True, False)
