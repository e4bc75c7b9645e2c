"""Tests of benchmarks/train_eagle3.py: a few self-distillation steps on demo-tiny fit its own
text (the loss falls), and the head it writes is read, checked and served by the engine,
drafting; its training forward is the speculators package's test-time training."""

from __future__ import annotations

from tests.benchmarks.scripts import load_script
from tests.model_executor.models.test_eagle3_head import (  # noqa: F401 (fixtures)
    LENGTH,
    STEPS,
    _reference,
    _write_head,
    speculators,
    target,
)
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.transformers_utils.eagle3_config import read_eagle3_head

eagle3_prompts = load_script("eagle3_prompts")  # train_eagle3 imports it by name
train_eagle3 = load_script("train_eagle3")


def test_a_few_steps_fit_the_text_and_write_a_head_the_engine_serves(tmp_path) -> None:
    out = tmp_path / "head"
    losses = train_eagle3.run(train_eagle3.parse([
        "--model", "demo-tiny", "--out", str(out), "--num-prompts", "2", "--output-len", "8",
        "--steps", "8", "--draft-vocab", "64", "--lr", "3e-3"]))
    assert len(losses) == 8
    # The two sequences take turns: each is fitted better the fourth time than the first.
    assert losses[6] < losses[0] and losses[7] < losses[1]
    target = EngineArgs(model="demo-tiny").create_engine_config().model_config.hf_config
    config = read_eagle3_head(out, target)
    assert (config.layout, config.draft_vocab_size, config.aux_layer_ids) == ("eagle3", 64,
                                                                              (0, 1, 2))
    assert not config.has_embedding  # the target's is shared
    llm = LLM("demo-tiny", max_num_seqs=2, speculative_config={
        "method": "eagle3", "model": str(out), "num_speculative_tokens": 2})
    try:
        outs = llm.generate(["a story about tea"], SamplingParams(max_tokens=8, temperature=0.0,
                                                                  ignore_eos=True),
                            use_tqdm=False)
        assert len(outs[0].outputs[0].token_ids) == 8
        assert llm.llm_engine.engine_core.scheduler.drafter.stats.num_draft_tokens > 0
    finally:
        llm.shutdown()


def test_the_training_forward_is_speculators_test_time_training(speculators, target,
                                                                tmp_path) -> None:
    """The head with the script's dense test-time-training attention gives, at every
    position and step, the logits of the speculators package's own training forward (the
    next tokens fed at each step, padding past the end) within 1e-5."""
    import torch

    from vllm.model_executor.models.eagle3_head import Eagle3Head

    target_dir, target_config = target
    path = _write_head(speculators, target_dir, target_config, tmp_path / "head", "llama", 1,
                       seed=4)
    head = Eagle3Head(read_eagle3_head(path, target_config),
                      train_eagle3.DenseTestTimeAttention, 64)
    head.load_weights()
    gen = torch.Generator().manual_seed(5)
    aux = torch.randn(LENGTH, 3 * target_config.hidden_size, generator=gen)
    tokens = torch.randint(0, target_config.vocab_size, (LENGTH + 1,), generator=gen)
    want = _reference(speculators, path, aux, tokens[1:])
    for layer in head.layers:
        layer.self_attn.attn.reset()
    padded = torch.cat([tokens, tokens.new_zeros(STEPS)])
    positions = torch.arange(LENGTH)
    hidden = head.combine(aux)
    with torch.no_grad():
        for s in range(STEPS):
            out = head(padded[1 + s : 1 + s + LENGTH], hidden, positions + s, [None], None)
            valid = LENGTH - s  # past the text's end both are fed padding
            assert (head.compute_logits(out)[:valid] - want[s][:valid]).abs().max() < 1e-5, s
            hidden = head.carry(out)


def test_prompts_are_many_and_varied() -> None:
    """The training prompts: mostly distinct (a head trained on a few dozen templated
    conversations fits them and guesses poorly elsewhere), chat requests of several kinds
    and plain-text openings in about the stated shares, the same for the same seed."""
    prompts = eagle3_prompts.make_prompts(400, seed=3)
    texts = [p.text if p.chat is None else p.chat[0]["content"] for p in prompts]
    assert len(set(texts)) >= 340  # the old fixed list had 84
    plain = [p for p in prompts if p.chat is None]
    assert 0.25 * 400 < len(plain) < 0.45 * 400
    asks = [p.chat[0]["content"] for p in prompts if p.chat is not None]
    assert sum("JSON" in a for a in asks) > 20 and sum("function" in a for a in asks) > 20
    assert eagle3_prompts.make_prompts(400, seed=3) == prompts
    assert eagle3_prompts.make_prompts(400, seed=4) != prompts


def test_held_out_agreement_compares_each_step_with_the_targets_greedy_token(
        speculators, target, tmp_path) -> None:
    """Step 0's row i predicts the token after position i + 1, the target's greedy token
    there (the argmax of the LM head over the final state at i + 1): a target made to
    agree with the head's step-0 guess on the first half of the rows, and to differ on the
    rest, gives exactly one half; the other steps are checked the same way, shifted."""
    import torch

    from vllm.model_executor.models.eagle3_head import Eagle3Head

    target_dir, target_config = target
    path = _write_head(speculators, target_dir, target_config, tmp_path / "head", "llama", 1,
                       seed=6)
    head = Eagle3Head(read_eagle3_head(path, target_config),
                      train_eagle3.DenseTestTimeAttention, 64)
    head.load_weights()
    gen = torch.Generator().manual_seed(8)
    vocab = target_config.vocab_size
    aux = torch.randn(LENGTH, 3 * target_config.hidden_size, generator=gen)
    tokens = torch.randint(0, vocab, (LENGTH + 1,), generator=gen)
    with torch.no_grad():
        guesses = [head.d2t_ids[logits.argmax(-1)]
                   for _, logits in train_eagle3.ttt_steps_logits(head, aux, tokens, STEPS)]
    for s in range(STEPS):
        want = guesses[s].clone()
        half = len(want) // 2
        want[half:] = (want[half:] + 1) % vocab
        final = torch.zeros(LENGTH + 1, vocab)
        final[torch.arange(len(want)) + 1 + s, want] = 1.0  # one-hot through an identity head
        agree = train_eagle3.held_out_agreement(head, [(aux, tokens, final)], STEPS,
                                                torch.eye(vocab))
        assert agree[s] == half / len(want), (s, agree)
