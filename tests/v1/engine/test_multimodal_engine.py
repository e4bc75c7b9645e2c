"""The engine with images (tiny random Qwen2.5-VL): the vision tower runs once per image
across a prefill split into chunks that cut image runs; preemption and recomputation keep
the image; prefix-cache blocks are keyed by image content; async scheduling equals sync on
JSON-schema requests with images (and so do chunked, preempted, -tp 2 and -pp 2 runs, and
n-gram drafts and grammar fast-forward); drafts from a model fail at startup naming the
method."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.utils_models import capture_logits
from tests.utils_vl import PLACEHOLDER, SCHEMA, image, shared_vl_checkpoint
from vllm import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

BLOCK = 16
# Text the demo vocabulary spells one token per character with no other token fitting:
# each of its positions allows a single token, which fast-forward appends.
FORCED_RUN = StructuredOutputsParams(regex=r"[a-z]{1,3}=\^`\^`\^`")


def _prompt(question: str, n: int = 1) -> str:
    return (f"<|im_start|>user\n{PLACEHOLDER * n}{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


def _requests() -> tuple[list[dict], list[SamplingParams]]:
    """Six image prompts (one with two images, two sharing an image), half of them under
    the JSON schema, greedy and seeded."""
    pictures = [image(64, 64, 0), image(40, 56, 1), image(30, 45, 2), image(64, 40, 3)]
    prompts = [
        {"prompt": _prompt("Describe."), "multi_modal_data": {"image": pictures[0]}},
        {"prompt": _prompt("Both?", 2), "multi_modal_data": {"image": pictures[1:3]}},
        {"prompt": _prompt("Again."), "multi_modal_data": {"image": pictures[0]}},
        {"prompt": _prompt("JSON please."), "multi_modal_data": {"image": pictures[3]}},
        {"prompt": _prompt("JSON again."), "multi_modal_data": {"image": pictures[1]}},
        {"prompt": _prompt("Seeded."), "multi_modal_data": {"image": pictures[2]}},
    ]
    json_params = dict(structured_outputs=StructuredOutputsParams(json=SCHEMA), max_tokens=40)
    params = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True),
        SamplingParams(temperature=0, **json_params),
        SamplingParams(temperature=1.0, seed=3, **json_params),
        SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True),
    ]
    return prompts, params


@pytest.fixture(scope="module")
def checkpoint() -> str:
    return str(shared_vl_checkpoint()[0])


def _engine(checkpoint: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 64 << 20)
    kwargs.setdefault("max_model_len", 512)
    return LLM(checkpoint, dtype="float32", max_num_seqs=8, block_size=BLOCK, **kwargs)


@pytest.fixture(scope="module")
def sync_llm(checkpoint: str):
    engine = _engine(checkpoint, async_scheduling=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def sync_outputs(sync_llm) -> list[list[int]]:
    prompts, params = _requests()
    return [list(o.outputs[0].token_ids)
            for o in sync_llm.generate(prompts, params, use_tqdm=False)]


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.model_executor.worker.model_runner


def test_json_schema_requests_with_images_are_valid(sync_llm, sync_outputs) -> None:
    tokenizer = sync_llm.get_tokenizer()
    for ids in sync_outputs[3:5]:
        jsonschema.validate(json.loads(tokenizer.decode(ids, skip_special_tokens=True)),
                            SCHEMA)


def test_async_chunked_preempted_equals_sync(checkpoint, sync_outputs) -> None:
    """Async scheduling, prefills of 24 tokens a step (every image run is cut) and a cache
    too small for the batch (requests are preempted and recomputed) give sync's tokens; the
    tower runs once per distinct image while nothing is evicted."""
    engine = _engine(checkpoint, max_num_batched_tokens=24, num_gpu_blocks_override=14,
                     max_model_len=224,
                     enable_prefix_caching=False, encoder_cache_size=4096)
    try:
        prompts, params = _requests()
        chunked_only = engine.generate(prompts[:2], params[:2], use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in chunked_only] == sync_outputs[:2]
        assert _runner(engine).mm.cache.encoder_runs == 3  # one image, then two
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == sync_outputs
        assert engine.llm_engine.engine_core.scheduler.num_preemptions > 0
    finally:
        engine.shutdown()


def test_prefix_cache_keys_blocks_by_image(sync_llm) -> None:
    """The same text with another image shares no block (the image starts in the first
    one); with the same image every full block hits, and the answer is the same."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    text = _prompt("Which one is it, exactly, in a few words?")
    first, other = image(64, 48, 20), image(64, 48, 21)
    captured = capture_logits(sync_llm)
    run = lambda picture: sync_llm.generate(  # noqa: E731
        {"prompt": text, "multi_modal_data": {"image": picture}}, params, use_tqdm=False)[0]
    a = run(first)
    b = run(other)
    c = run(first)
    assert len(a.prompt_token_ids) > 3 * BLOCK  # several blocks, all holding image tokens
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 0
    assert c.num_cached_tokens == (len(a.prompt_token_ids) - 1) // BLOCK * BLOCK
    logits = {k: captured[o.request_id][0] for k, o in zip("abc", (a, b, c))}
    assert (logits["c"] - logits["a"]).abs().max() < 1e-4  # the cached blocks are a's
    assert (logits["b"] - logits["a"]).abs().max() > 1e-2  # the image reached the model


@pytest.mark.parametrize("kwargs", [
    dict(tensor_parallel_size=2),
    dict(pipeline_parallel_size=2, max_num_batched_tokens=24),
], ids=["tp2", "pp2-chunked"])
def test_parallel_mp_executor_equals_uni(checkpoint, sync_outputs, kwargs) -> None:
    """On the mp executor, async: -tp 2 (each rank runs the whole vision tower and half
    the heads) and -pp 2 with prefills of 24 tokens a step (the first stage encodes and
    merges the images, the second takes only the M-RoPE positions) give one rank's
    tokens."""
    engine = _engine(checkpoint, **kwargs)
    try:
        prompts, params = _requests()
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == sync_outputs
    finally:
        engine.shutdown()


@pytest.mark.parametrize("spec, kwargs", [
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
     {"max_num_batched_tokens": 24}),
    ({"method": "grammar", "num_speculative_tokens": 8},
     {"distributed_executor_backend": "mp"}),
], ids=["ngram-chunked", "fast-forward-mp"])
def test_drafts_change_no_output(checkpoint, sync_llm, spec, kwargs) -> None:
    """Async scheduling with drafts: n-gram lookups (prefills cut into 24-token chunks) and
    grammar fast-forward (mp executor) give sync's tokens without drafts, on the workload
    with one request under a regex that forces runs of single tokens. A request verified
    while its previous step was in flight starts after the tokens it kept, placed on the
    device, and its M-RoPE positions (its index plus the images' delta) follow."""
    prompts, params = _requests()
    params[5] = SamplingParams(temperature=0, max_tokens=24, structured_outputs=FORCED_RUN)
    want = [o.outputs[0].token_ids for o in sync_llm.generate(prompts, params, use_tqdm=False)]
    engine = _engine(checkpoint, speculative_config=spec, **kwargs)
    try:
        outs = engine.generate(prompts, params, use_tqdm=False)
        stats = engine.llm_engine.engine_core.scheduler.drafter.stats
    finally:
        engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
    assert stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_drafts_from_a_model_are_refused_at_startup(checkpoint, method) -> None:
    with pytest.raises(ValueError, match=f"^--speculative-config.method: '{method}' drafts "):
        _engine(checkpoint, speculative_config={"method": method, "model": checkpoint,
                                                "num_speculative_tokens": 2})
