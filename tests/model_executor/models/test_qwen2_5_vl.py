"""Qwen2.5-VL against transformers, on a tiny random checkpoint that transformers writes:
image preprocessing and placeholder counts, every step's logits (one and two images of
different sizes, text after and between images, decodes at M-RoPE's shifted positions),
greedy tokens, text-only requests, LLM.chat with image parts, and the loader's layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.utils_models import capture_logits
from tests.utils_vl import (
    IMAGE_TOKEN_ID,
    PLACEHOLDER,
    PREPROCESSOR,
    chat_prompt,
    greedy_agreement_with_transformers,
    hf_image_inputs,
    image,
    shared_vl_checkpoint,
)
from vllm import LLM, SamplingParams
from vllm.config import ModelConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader.demo_model import build_demo_model
from vllm.model_executor.model_loader.loader import get_model
from vllm.multimodal.processor import MultiModalProcessor
from vllm.multimodal.qwen_vl_image import (
    QwenVLImageConfig,
    num_image_tokens,
    preprocess,
)

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

MAX_TOKENS = 32
# (image sizes, question): one image, two of different sizes, none.
PROMPTS = [
    ([(30, 45)], "What is in the picture?"),
    ([(40, 56)], "Describe it."),
    ([(30, 45), (40, 56)], "Compare the two."),
    ([(64, 20)], "A tall one."),
    ([(12, 9)], "A tiny one (scaled up to the minimum)."),
    ([(90, 120), (30, 45)], "Big, then small."),
    ([], "No image at all."),
    ([(50, 50)], ""),
]


@pytest.fixture(scope="module")
def checkpoint():
    return shared_vl_checkpoint()


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = LLM(str(checkpoint[0]), dtype="float32", max_model_len=512,
                 kv_cache_memory=64 << 20, max_num_seqs=8)
    yield engine
    engine.shutdown()


def test_preprocessing_and_placeholder_counts_match_transformers(checkpoint) -> None:
    path, _ = checkpoint
    config = QwenVLImageConfig.from_dir(path, ModelConfig(model=str(path)).hf_config
                                        .vision_config)
    sizes = [(30, 45), (40, 56), (12, 9), (90, 120), (300, 7)]
    images = [image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    want = hf_image_inputs(images)
    ours = [preprocess(im, config) for im in images]
    assert [list(g) for _, g in ours] == want["image_grid_thw"].tolist()
    np.testing.assert_allclose(np.concatenate([p for p, _ in ours]),
                               want["pixel_values"].numpy(), rtol=0, atol=1e-6)
    counts = [num_image_tokens(g, config) for _, g in ours]
    assert counts == (want["image_grid_thw"].prod(-1) // 4).tolist()
    assert len(set(counts)) == len(counts)  # the sizes give different counts


def test_logits_and_greedy_tokens_match_transformers(checkpoint, llm) -> None:
    _, hf = checkpoint
    assert greedy_agreement_with_transformers(llm, hf, PROMPTS, MAX_TOKENS) >= 0.9


def test_text_only_requests_run_as_the_text_model(checkpoint, llm) -> None:
    """A text request's logits are transformers' text model's, alone and batched beside
    an image request."""
    _, hf = checkpoint
    text = chat_prompt([], "Just text, please.")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    captured = capture_logits(llm)
    alone = llm.generate([text], params, use_tqdm=False)[0]
    mixed = llm.generate([{"prompt": chat_prompt([(30, 45)], "x"),
                           "multi_modal_data": {"image": image(30, 45, 7)}}, text],
                         params, use_tqdm=False)[1]
    assert mixed.outputs[0].token_ids == alone.outputs[0].token_ids
    ids = list(alone.prompt_token_ids) + list(alone.outputs[0].token_ids)
    with torch.inference_mode():
        want = hf(input_ids=torch.tensor([ids])).logits[0, len(alone.prompt_token_ids) - 1:-1]
    for out in (alone, mixed):
        assert (torch.stack(captured[out.request_id]) - want).abs().max().item() < 1e-4


def test_chat_with_image_parts_equals_generate(llm) -> None:
    pictures = [image(30, 45, 1), image(40, 56, 2)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    chat = llm.chat([{"role": "user", "content": [
        {"type": "image_pil", "image_pil": pictures[0]},
        {"type": "text", "text": "and"},
        {"type": "image_pil", "image_pil": pictures[1]},
    ]}], params, use_tqdm=False)[0]
    text = f"<|im_start|>user\n{PLACEHOLDER}and{PLACEHOLDER}<|im_end|>\n<|im_start|>assistant\n"
    plain = llm.generate({"prompt": text, "multi_modal_data": {"image": pictures}}, params,
                         use_tqdm=False)[0]
    assert chat.prompt_token_ids == plain.prompt_token_ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    # Another image, another answer: the image reaches the model.
    other = llm.generate({"prompt": text, "multi_modal_data": {
        "image": [pictures[1], pictures[0]]}}, params, use_tqdm=False)[0]
    assert other.outputs[0].token_ids != plain.outputs[0].token_ids


@pytest.mark.parametrize("images, prompt, match", [
    ([], PLACEHOLDER, r"prompt: has 1 image placeholders .* but 0 images"),
    ("two", PLACEHOLDER, r"prompt: has 1 image placeholders .* but 2 images"),
    (["not an image"], PLACEHOLDER, r"multi_modal_data.image\[0\]: must be a PIL image"),
])
def test_bad_image_prompts_are_refused(llm, images, prompt, match) -> None:
    if images == "two":
        images = [image(8, 8, 0), image(8, 8, 1)]
    with pytest.raises(ValueError, match=match):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}},
                     use_tqdm=False)


def test_nested_checkpoint_layout_loads(checkpoint, tmp_path) -> None:
    """The newer layout (model.visual.*, model.language_model.*) loads the same weights;
    a missing vision tensor is named."""
    path, _ = checkpoint
    for name in ("config.json", "preprocessor_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    flat = load_file(path / "model.safetensors")
    nested = {("model.visual." + k[7:] if k.startswith("visual.") else
               "model.language_model." + k[6:] if k.startswith("model.") else k): v
              for k, v in flat.items()}
    save_file(nested, tmp_path / "model.safetensors")
    config = dict(dtype="float32", attention_backend="torch")
    a = get_model(ModelConfig(model=str(path), **config)).state_dict()
    b = get_model(ModelConfig(model=str(tmp_path), **config)).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    del nested["model.visual.merger.ln_q.weight"]
    save_file(nested, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor 'visual.merger.ln_q.weight'"):
        get_model(ModelConfig(model=str(tmp_path), **config))


def test_mm_processor_kwargs_flag_and_prompt_field(checkpoint, llm) -> None:
    """A prompt's mm_processor_kwargs (generate and LLM.chat) and the engine's
    --mm-processor-kwargs size an image as transformers' processor does with the same
    kwargs; a prompt's keys win over the engine's; refused keys are named."""
    path, _ = checkpoint
    picture = image(64, 64, 1)
    small = {"min_pixels": 256, "max_pixels": 1024}

    def hf_count(settings: dict) -> int:
        grid = hf_image_inputs([picture], {**PREPROCESSOR, **settings})["image_grid_thw"]
        return int(grid.prod(-1).item()) // 4

    want_small, want_default = hf_count(small), hf_count({})
    assert want_small < want_default
    text = chat_prompt([(64, 64)], "x")
    params = SamplingParams(max_tokens=1)
    prompt = {"prompt": text, "multi_modal_data": {"image": picture}}
    outs = llm.generate([dict(prompt, mm_processor_kwargs=small), prompt], params,
                        use_tqdm=False)
    chat = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": picture}]}],
                    params, use_tqdm=False, mm_processor_kwargs=small)[0]
    counts = [o.prompt_token_ids.count(IMAGE_TOKEN_ID) for o in (*outs, chat)]
    assert counts == [want_small, want_default, want_small]
    with pytest.raises(ValueError, match=r"^mm_processor_kwargs\.fps: .*not supported"):
        llm.generate(dict(prompt, mm_processor_kwargs={"fps": 1}), use_tqdm=False)

    # The flag, as the engine's processor reads it (no engine needed).
    config = EngineArgs(model=str(path), mm_processor_kwargs={
        "size": {"shortest_edge": 256, "longest_edge": 1024}}).create_engine_config()
    processor = MultiModalProcessor.for_model(config.model_config, config.multimodal_config)
    ids = [IMAGE_TOKEN_ID]
    assert len(processor.process(ids, [picture], ["x"])[0]) == want_small
    own = processor.image_config_for({"max_pixels": 4096})
    assert len(processor.process(ids, [picture], ["x"], image_config=own)[0]) == want_default
    with pytest.raises(ValueError, match=r"^--mm-processor-kwargs\.fps: "):
        EngineArgs(model=str(path), mm_processor_kwargs={"fps": 1}).create_engine_config()
    with pytest.raises(ValueError, match=r"^--mm-processor-kwargs: .*not a vision-language"):
        EngineArgs(model=str(build_demo_model("demo-tiny")),
                   mm_processor_kwargs=small).create_engine_config()
