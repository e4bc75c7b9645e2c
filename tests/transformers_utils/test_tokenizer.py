"""Tests for vllm/transformers_utils/tokenizer.py on the demo model's tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from vllm.model_executor.model_loader.demo_model import build_demo_model
from vllm.transformers_utils.qwen_vocab import ADDED_TOKENS
from vllm.transformers_utils.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def model_dir() -> Path:
    # The default cache: built once per machine, shared by other test modules.
    return build_demo_model("demo-tiny")


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> PreTrainedTokenizerFast:
    return get_tokenizer(model_dir)


def chatml(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def test_encode_known_ids(tok: PreTrainedTokenizerFast) -> None:
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok.encode("Hello world") == [9707, 1879]
    assert tok.encode("Hello, world!") == [9707, 11, 1879, 0]


@pytest.mark.parametrize(
    "text",
    [
        "mixed English 与中文 and emoji 🤖🧪",
        "x = [i**2 for i in range(10)]\n\tprint(x)\n",
        "  \n\n ",
    ],
)
def test_round_trip(tok: PreTrainedTokenizerFast, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens(tok: PreTrainedTokenizerFast) -> None:
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643
    assert tok.bos_token is None
    special = {151643 + i for i, (_, is_special) in enumerate(ADDED_TOKENS) if is_special}
    assert set(tok.all_special_ids) == special
    for i, (content, _) in enumerate(ADDED_TOKENS):
        assert tok.convert_tokens_to_ids(content) == 151643 + i
    ids = tok.encode("<|im_start|>user<think>hi</think><|im_end|>")
    assert ids[0] == 151644 and ids[-1] == 151645
    # Non-special added tokens (<think>) survive skip_special_tokens; special ones do not.
    assert tok.decode(ids, skip_special_tokens=True) == "user<think>hi</think>"
    assert tok.decode(ids) == "<|im_start|>user<think>hi</think><|im_end|>"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template(tok: PreTrainedTokenizerFast, add_generation_prompt: bool) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "你好"},
    ]
    expected = chatml(messages, add_generation_prompt)
    text = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert text == expected
    ids = tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert ids == tok.encode(expected)


def test_chat_template_tools(tok: PreTrainedTokenizerFast) -> None:
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    messages = [
        {"role": "user", "content": "add 1 and 2"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
        },
        {"role": "tool", "content": "3"},
    ]
    text = tok.apply_chat_template(
        messages, tools=[tool], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert "<tools>\n" + json.dumps(tool) + "\n</tools>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
        "</tool_call><|im_end|>\n"
    ) in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_xgrammar_accepts(tok: PreTrainedTokenizerFast) -> None:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(
        tok, vocab_size=151936, stop_token_ids=[151645, 151643]
    )
    assert info.vocab_type == xgrammar.VocabType.BYTE_LEVEL
    assert info.vocab_size == 151936
    assert sorted(info.stop_token_ids) == [151643, 151645]


def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="nope"):
        get_tokenizer(missing)
    with pytest.raises(ValueError, match=str(tmp_path.name)):
        get_tokenizer(tmp_path)


def test_chat_template_file_overrides(model_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(model_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = get_tokenizer(str(tmp_path))
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}], tokenize=False) == "hey!"
