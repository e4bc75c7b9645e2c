"""Tests for vllm/v1/engine/output_processor.py: several tokens in one engine output (kept
drafts of speculative decoding) end on a stop string where one token per step would, and a
final-only request's text, detokenized once, equals the step-by-step text."""

from __future__ import annotations

import random

import pytest

from vllm.outputs import OutputKind
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.engine.output_processor import OutputProcessor


@pytest.fixture(scope="module")
def tokenizer():
    from vllm.model_executor.model_loader.demo_model import build_demo_model

    return get_tokenizer(str(build_demo_model("demo-tiny")))


def _finish(tokenizer, chunks: list[list[int]], **params) -> tuple[object, list[str]]:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, tokenizer.encode("Say:"), SamplingParams(**params))
    aborted: list[str] = []
    result = None
    for chunk in chunks:
        # The engine does not know about stop strings: it keeps going.
        outs, to_abort = processor.process_outputs([EngineCoreOutput(
            request_id="r", new_token_ids=chunk)])
        aborted += to_abort
        if outs:
            result = outs[0].outputs[0]
        if result is not None and result.finish_reason is not None:
            break
    return result, aborted


@pytest.mark.parametrize("stop, include", [("cat", False), ("cat", True)])
def test_stop_string_inside_a_multi_token_output(tokenizer, stop: str, include: bool) -> None:
    ids = tokenizer.encode(" the cat sat on the mat")
    one_by_one, aborted_one = _finish(tokenizer, [[t] for t in ids], stop=[stop],
                                      include_stop_str_in_output=include)
    at_once, aborted_all = _finish(tokenizer, [ids[:1], ids[1:]], stop=[stop],
                                   include_stop_str_in_output=include)
    assert one_by_one.finish_reason == "stop" and one_by_one.stop_reason == stop
    assert at_once.text == one_by_one.text
    assert at_once.token_ids == one_by_one.token_ids
    assert len(at_once.token_ids) < len(ids)  # the tokens after the stop string are dropped
    assert (at_once.finish_reason, at_once.stop_reason) == ("stop", stop)
    assert aborted_all == aborted_one == ["r"]


def test_multi_token_output_without_stop_strings_is_kept_whole(tokenizer) -> None:
    ids = tokenizer.encode(" one two three")
    out, aborted = _finish(tokenizer, [ids], max_tokens=16)
    assert out.token_ids == ids and out.text == " one two three" and not aborted
    assert out.finish_reason is None


def _random_ids(seed: int, vocab_size: int) -> list[int]:
    """What a random model writes: byte tokens that split characters, special tokens."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 40))]


@pytest.mark.parametrize("text", [
    " the cat sat on the mat", " naïve café 🤖 日本語 ✓✓", "\n\n  x",
    *(f"random:{seed}" for seed in range(20)),
])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_final_only_detokenizes_once_to_the_same_text(
    tokenizer, text: str, skip_special_tokens: bool
) -> None:
    if text.startswith("random:"):
        ids = _random_ids(int(text.split(":")[1]), len(tokenizer))
    else:
        ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    outputs = {}
    for kind in (OutputKind.CUMULATIVE, OutputKind.FINAL_ONLY):
        processor = OutputProcessor(tokenizer)
        processor.add_request("r", None, tokenizer.encode("Say:"), params, kind)
        seen = []
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            outs, _ = processor.process_outputs([EngineCoreOutput(
                request_id="r", new_token_ids=[token], finish_reason="stop" if last else None)])
            seen += outs
        outputs[kind] = seen
    cumulative, final = outputs[OutputKind.CUMULATIVE], outputs[OutputKind.FINAL_ONLY]
    assert len(cumulative) == len(ids) and len(final) == 1
    assert final[0].finished and final[0].outputs == cumulative[-1].outputs
    assert final[0].outputs[0].text  # the text is there, not skipped
