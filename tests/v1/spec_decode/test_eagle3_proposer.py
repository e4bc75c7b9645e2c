"""Oracles for vllm/v1/spec_decode/eagle3_proposer.py (the runner's EAGLE-3 drafting) and
worker_drafts.py (the scheduler's side).

Through the offline engine, a tiny random Llama target and a random head (reduced draft
vocabulary, 4-token blocks so drafted positions cross into scratch blocks): after every step,
the drafts the runner proposed must be the head's greedy chain computed afresh over the whole
sequence, from the target's hidden states as Hugging Face's transformers computes them (the
residual stream entering layers 0 and 1, and the last layer's output before the final norm).
Each draft is checked as an argmax of the reference logits (to 1e-4, for float sums in
another order), the chain fed the engine's own drafts. A random head's drafts are rejected,
so (synchronous run) each verification is also proposed from as if all its drafts were kept:
the head's cache and newest drafts are put back afterwards, and that world's drafts must be
the chain after the drafts and the new sample.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.utils_eagle3 import write_eagle3_head
from tests.utils_models import TINY, build_checkpoint
from vllm import LLM, SamplingParams, StructuredOutputsParams
from vllm.attention.backends.abstract import AttentionMetadata
from vllm.attention.backends.torch_backend import TorchAttentionBackend
from vllm.model_executor.model_loader.demo_model import build_demo_model
from vllm.model_executor.models.eagle3_head import Eagle3Head
from vllm.transformers_utils.eagle3_config import read_eagle3_head
from vllm.v1.spec_decode.worker_drafts import WorkerDrafts

K = 3
AUX = [0, 1, 2]  # the tiny Llama has 2 layers: 2 is its output before the final norm
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    hf = build_checkpoint("llama", root / "target", seed=11)
    vocab = random.Random(2).sample(range(TINY["vocab_size"]), 128)
    write_eagle3_head(root / "head", hf.config, aux_layer_ids=AUX, draft_vocab=vocab, seed=12)
    return root, hf, vocab


def _single(n: int, seq_len: int, positions: torch.Tensor) -> AttentionMetadata:
    """One sequence whose last n positions are new, its cache in blocks 0, 1, ... of 16."""
    cu = torch.tensor([0, n], dtype=torch.int32)
    seq = torch.tensor([seq_len], dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=n, num_reqs=1, max_query_len=n, max_seq_len=seq_len,
        query_start_loc=cu, seq_lens=seq, block_table=torch.arange(16, dtype=torch.int32)[None],
        slot_mapping=positions.clone(), query_start_loc_cpu=cu, seq_lens_cpu=seq)


def _check_chain(head: Eagle3Head, hf, tokens: list[int], drafts: list[int],
                 draft_index: dict[int, int]) -> None:
    """Each of `drafts` (proposed after `tokens`) is an argmax of the head's reference
    logits, the chain fed the earlier drafts."""
    ids = torch.tensor([tokens])
    states: list[torch.Tensor] = []
    hook = hf.model.norm.register_forward_hook(lambda m, i, o: states.append(i[0]))
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    hook.remove()
    # transformers' hidden_states[i] enters layer i; its last is after the final norm.
    aux = torch.cat([out.hidden_states[i] if i < 2 else states[0] for i in AUX], dim=-1)[0]
    n = len(tokens) - 1
    caches = [torch.zeros(TorchAttentionBackend.kv_cache_shape(16, 16, 2, 16))]
    positions = torch.arange(n)
    with torch.no_grad():
        x = head(ids[0, 1:], head.combine(aux[:n]), positions, caches,
                 _single(n, n, positions))[-1:]
        for j, draft in enumerate(drafts):
            logits = head.compute_logits(x)[0]
            assert draft in draft_index, (tokens, drafts)
            assert logits[draft_index[draft]] >= logits.max() - TOLERANCE, (tokens, drafts, j)
            position = torch.tensor([n + j])
            x = head(torch.tensor([draft]), head.carry(x), position, caches,
                     _single(1, n + j + 1, position))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_proposals_are_the_heads_greedy_chain(models, async_scheduling) -> None:
    """Async: a batch of four, one of them constrained (by a regex any text meets), so
    that steps sampling it draft 2K + 1 tokens. Sync: one request at a time in 8-token
    steps, so that steps computing only part of a prompt (nothing sampled) must feed the
    head's cache too."""
    root, hf, vocab = models
    shape = ({"max_num_seqs": 4} if async_scheduling
             else {"max_num_seqs": 1, "max_num_batched_tokens": 8})
    llm = LLM(model=str(root / "target"), tokenizer=str(build_demo_model("demo-tiny")),
              dtype="float32", max_model_len=128, block_size=4, **shape,
              async_scheduling=async_scheduling,
              speculative_config={"method": "eagle3", "model": str(root / "head"),
                                  "num_speculative_tokens": K})
    scheduler = llm.llm_engine.engine_core.scheduler
    update = scheduler.update_from_output
    seen: list[tuple[list[int], list[int]]] = []

    def recording_update(scheduler_output, output):
        outputs = update(scheduler_output, output)
        for req_id, drafts in (output.draft_token_ids or {}).items():
            request = scheduler.requests.get(req_id)
            if request is not None:
                seen.append((list(request.all_token_ids), drafts))
        return outputs

    scheduler.update_from_output = recording_update
    what_if: list[tuple[list[int], list[int]]] = []
    if not async_scheduling:
        runner = llm.llm_engine.engine_core.model_executor.worker.model_runner
        _what_if_all_kept(runner.eagle3, scheduler, what_if)
    rng = random.Random(5)
    prompts = [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in (3, 9, 14, 6)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)]
    params = [params[i % 2] for i in range(4)]
    if async_scheduling:
        params[0] = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                   structured_outputs=StructuredOutputsParams(regex=r"[\s\S]*"))
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = scheduler.drafter.stats
    llm.shutdown()
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert len(seen) >= 4 * 12 // (K + 1)
    config = read_eagle3_head(root / "head", hf.config)
    head = Eagle3Head(config, TorchAttentionBackend, 256, hf.model.embed_tokens)
    head.load_weights()
    draft_index = {t: d for d, t in enumerate(vocab)}
    for tokens, drafts in seen + what_if:
        assert len(drafts) in ((K, 2 * K + 1) if async_scheduling else (K,))
        _check_chain(head, hf, tokens, drafts, draft_index)
    assert any(len(d) == 2 * K + 1 for _, d in seen) == async_scheduling
    assert bool(what_if) != async_scheduling
    assert stats.num_draft_tokens > 0  # the engine verified the head's drafts


def test_lora_adapters_keep_their_outputs(models, tmp_path) -> None:
    """LoRA adapters change the target's hidden states the head reads; outputs of a batch
    mixing an adapter and the base model are those without drafts, drafts verified."""
    from tests.lora.utils import build_adapter
    from vllm.lora.request import LoRARequest

    root, hf, _ = models
    build_adapter(hf, tmp_path / "adapter", seed=3, targets=["q_proj", "down_proj"])
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    rng = random.Random(9)
    prompts = [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in (5, 11, 4, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def run(spec: dict | None) -> tuple[list, int]:
        llm = LLM(model=str(root / "target"), tokenizer=str(build_demo_model("demo-tiny")),
                  dtype="float32", max_model_len=128, block_size=4, enable_lora=True,
                  speculative_config=spec)
        outs = llm.generate(prompts, params, use_tqdm=False,
                            lora_request=[lora, None, lora, None])
        drafted = llm.llm_engine.engine_core.scheduler.drafter.stats.num_draft_tokens
        llm.shutdown()
        return [o.outputs[0].token_ids for o in outs], drafted

    got, drafted = run({"method": "eagle3", "model": str(root / "head"),
                        "num_speculative_tokens": K})
    assert drafted > 0
    assert got == run(None)[0]


def _what_if_all_kept(proposer, scheduler, found: list) -> None:
    """Wraps proposer.propose: before each real call, one as if every draft of the step was
    kept (and the first sample came after them), whose state is then put back; records
    (tokens of that world, its drafts) per request that verified drafts."""
    propose = proposer.propose

    def wrapped(step, kept, num_rows, req_ids, depth=None):
        if kept is not None and max(num_rows) > 1:
            caches = [c.clone() for c in proposer.kv_caches]
            latest = dict(proposer._latest)
            first = torch.as_tensor(step.cu[1:][step.sampled] - num_rows)
            fake = kept.clone()
            for i, rows in enumerate(num_rows):
                drafts = step.input_ids[first[i] + 1 : first[i] + rows]
                fake[i, : rows - 1] = drafts
                fake[i, rows - 1] = kept[i, 0]
            drafts = propose(step, fake, num_rows, req_ids, depth).tolist()
            for c, saved in zip(proposer.kv_caches, caches):
                c.copy_(saved)
            proposer._latest = latest
            for i, (req_id, rows) in enumerate(zip(req_ids, num_rows)):
                if rows > 1:
                    world = list(scheduler.requests[req_id].all_token_ids)
                    found.append((world + fake[i, :rows].tolist(), drafts[i]))
        return propose(step, kept, num_rows, req_ids, depth)

    proposer.propose = wrapped


def test_worker_drafts_continue_the_context_they_follow() -> None:
    drafts = WorkerDrafts(3)
    drafts.store("a", 5, [7, 8, 9])
    base = [1, 2, 3, 4, 5]
    # Nothing after the tokens they follow: the drafts, cut to the limit.
    assert drafts.propose_batch({"a": (base, 5, 2)}) == {"a": [7, 8]}
    # Forced or assumed tokens they predicted: the rest follows.
    assert drafts.propose_batch({"a": (base + [7], 5, 3)}) == {"a": [8, 9]}
    # Tokens they did not predict, or past them all: nothing.
    assert drafts.propose_batch({"a": (base + [6], 5, 3)}) == {}
    assert drafts.propose_batch({"a": (base + [7, 8, 9], 5, 3)}) == {}
    assert drafts.propose_batch({"a": (base[:4], 4, 3), "b": (base, 5, 3)}) == {}
    drafts.release("a")
    assert drafts.propose_batch({"a": (base, 5, 3)}) == {}
