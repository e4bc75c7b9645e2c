"""The post-layer function (LM head + bitmask + token edits + penalties + sampling from
fixed buffers and per-request tables) and its buffers: one upload per step, one operation
sequence per (size, plan, masked, edited) whatever each row's mode and table row, nothing that would make a CUDA host wait (counted with OpAudit, never timed); token
edits and penalties give the eager path's tokens, step after step; and in the engine (CPU,
run eagerly) the same tokens as the eager path, with the operations outside the model not
growing with the batch."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.sample.ops.dense_sampling import Plan
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu_input_batch import CachedRequestState
from vllm.v1.worker.grammar_bitmask import apply_grammar_bitmask
from vllm.v1.worker.op_audit import OpAudit
from vllm.v1.worker.post_layer import PostLayer
from vllm.v1.worker.sampling_buffers import SamplingBuffers
from vllm.v1.worker.sampling_inputs import SamplingInputs

VOCAB = 100


def _params(n: int, mode: str, table_rows=None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    greedy = mode == "greedy"
    return {
        "keys": rng.integers(0, 1 << 32, (n, 2), dtype=np.int64),
        "top_k": np.full(n, 5 if mode == "filtered" else 0, dtype=np.int64),
        "temperature": np.full(n, 0.0 if greedy else 0.8, dtype=np.float32),
        "top_p": np.full(n, 0.7 if mode == "filtered" else 1.0, dtype=np.float32),
        "min_p": np.full(n, 0.1 if mode == "min_p" else 0.0, dtype=np.float32),
        **({} if table_rows is None else {"table_rows": np.asarray(table_rows, dtype=np.int64)}),
    }


def test_buffers_take_one_copy_per_step_and_pad_with_off_rows() -> None:
    buffers = SamplingBuffers(8, VOCAB, torch.device("cpu"))
    mask = np.zeros((3, buffers.words), dtype=np.int32)
    mask[2, 0] = 0b1010
    audit = OpAudit("cpu")
    with audit:
        buffers.stage(_params(3, "filtered", table_rows=[3, 16, 5]), [2], 4, mask)
    assert audit.counts()["aten.copy_"] == 1 and audit.syncs == []
    rows = buffers.rows(4)
    assert rows.top_k.tolist() == [5, 5, 5, 0]
    assert rows.temperature.tolist()[3] == 0.0 and rows.top_p.tolist()[3] == 1.0
    assert rows.keys[3].tolist() == [0, 0]
    bits = buffers.bitmask(4)
    assert bits[2, 0] == 0b1010 and (bits[[0, 1, 3]] == -1).all()
    # Padding rows read the request tables' spare slot (row 2 x 8).
    assert buffers.table_rows(4).tolist() == [3, 16, 5, 16]
    buffers.stage(_params(3, "random"), [], 4)  # no table rows given: all spare
    assert buffers.table_rows(8).tolist() == [16] * 8
    with pytest.raises(ValueError, match="mask_rows"):
        buffers.stage(None, [4], 4, np.zeros((5, buffers.words), dtype=np.int32))


def _post_layer(max_rows: int = 8, history=None) -> PostLayer:
    head = torch.nn.Linear(16, VOCAB, bias=False).requires_grad_(False)
    torch.nn.init.normal_(head.weight, std=2.0, generator=torch.Generator().manual_seed(0))
    return PostLayer(lambda h: head(h).float(), 16, torch.float32, VOCAB, max_rows,
                     torch.device("cpu"), torch.Generator().manual_seed(0), history=history)


def _fill_tables(tables) -> None:
    """Random contents in every request table (drawn on the CPU, copied to their device)."""
    g = torch.Generator().manual_seed(3)
    tables.masks.copy_(torch.randint(-(2**31), 2**31, tables.masks.shape, generator=g))
    tables.bias_ids.copy_(torch.randint(0, VOCAB, tables.bias_ids.shape, generator=g))
    tables.bias_values.copy_(torch.empty(tables.bias_values.shape).uniform_(-100, 100,
                                                                            generator=g))
    tables.penalty.copy_(torch.empty(tables.penalty.shape).uniform_(0.5, 2.0, generator=g))
    tables.counts.copy_(torch.randint(0, 3, tables.counts.shape, generator=g))
    tables.prompt.copy_(torch.rand(tables.prompt.shape, generator=g) < 0.2)


@pytest.mark.parametrize("plan", list(Plan))
def test_one_operation_sequence_per_size_plan_and_grammar(plan: Plan) -> None:
    """Rows of every mode and any rows of the request tables (whatever they hold), staged in
    turn (and new hidden states): the same operations, none that would wait, so one
    captured graph replays every step of that size, plan, mask and edits."""
    post = _post_layer(history=lambda states: None)  # no slot is ever rebuilt here
    _fill_tables(post.slots)
    mask = np.full((4, post.buffers.words), -1, dtype=np.int32)
    mask[1, :2] = 0
    flags = [(m, e) for m in (False, True) for e in (False, True)]
    first = {}
    for masked, edited in flags:
        sequences = []
        for step, mode in enumerate(("greedy", "random", "min_p", "filtered")):
            table_rows = [16, 2 * step, 16, 15 - step]  # 16: the spare slot's row
            post.buffers.stage(_params(4, mode, table_rows), [1] if masked else [], 4, mask)
            post.hidden.normal_()
            audit = OpAudit("cpu")
            with audit:
                post.run(4, plan, masked, edited)
            assert audit.syncs == [] and audit.downloads == []
            sequences.append(audit.ops)
        assert all(s == sequences[0] for s in sequences), (masked, edited)
        first[masked, edited] = sequences[0]
        if masked and plan is Plan.GREEDY:
            assert int(post.tokens[1]) >= 64  # the mask forbids the row's first 64 tokens
    # Each flag adds its operations (the graphs differ).
    assert len({tuple(ops) for ops in first.values()}) == len(flags)


def test_sample_gives_the_samplers_tokens_with_a_grammar() -> None:
    """PostLayer.sample against the runner's eager path on the same hidden rows: LM head,
    native bitmask, SamplingInputs metadata and the default Sampler, with a generator
    seeded alike (it must advance alike). A request with logprobs gets None back, and
    nothing is drawn for it."""
    post = _post_layer()
    specs = [{"temperature": 0.0}, {"temperature": 0.8, "seed": 3}, {"temperature": 1.0},
             {"temperature": 1.0, "top_k": 5}, {"temperature": 0.7, "top_p": 0.6, "min_p": 0.05}]
    states = [CachedRequestState(f"r{i}", [1, 2], SamplingParams(**spec), [], 2,
                                 num_output_tokens=i) for i, spec in enumerate(specs)]
    req_ids = [s.req_id for s in states]
    hidden = torch.randn(12, 16, generator=torch.Generator().manual_seed(1))
    rows = post.gather(hidden, np.array([2, 4, 6, 9, 12]), torch.from_numpy)
    assert rows.shape == (8, 16)  # padded to the ladder's size
    rng = np.random.default_rng(2)
    grammar = GrammarOutput(["r1", "r3"], rng.integers(-(2**31), 2**31, (2, 4), dtype=np.int32))
    reference = torch.Generator().manual_seed(0)
    for _ in range(2):  # twice: the generators must stay in step
        got = post.sample(rows, states, grammar, req_ids).sampled_token_ids
        logits = post.compute_logits(rows)[:5].contiguous()
        apply_grammar_bitmask(logits, grammar, {r: i for i, r in enumerate(req_ids)})
        metadata = SamplingInputs(torch.from_numpy, reference, VOCAB, torch.device("cpu"),
                                  list).build(states)
        want = Sampler(fixed_shape=False)(logits, metadata).sampled_token_ids
        assert torch.equal(got, want)
    before = post.generator.get_state()
    states.append(CachedRequestState("r5", [1], SamplingParams(temperature=1.0, logprobs=1),
                                     [], 1))
    rows = post.gather(hidden, np.arange(1, 7), torch.from_numpy)
    assert post.sample(rows, states, None, req_ids + ["r5"]) is None
    assert torch.equal(post.generator.get_state(), before)


def _eager_tokens(post, rows, states, grammar, generator, unsettled=list) -> torch.Tensor:
    """The runner's eager path as CUDA runs it: LM head, bitmask, SamplingInputs and the
    Sampler's fixed-shape path (the CPU's default path differs on a row that forbids every
    token, whose token means nothing)."""
    req_ids = [s.req_id for s in states]
    logits = post.compute_logits(rows)[: len(states)].contiguous()
    if grammar is not None:
        apply_grammar_bitmask(logits, grammar, {r: i for i, r in enumerate(req_ids)})
    metadata = SamplingInputs(torch.from_numpy, generator, VOCAB, torch.device("cpu"),
                              unsettled).build(states)
    return Sampler(fixed_shape=True)(logits, metadata).sampled_token_ids


def test_token_edits_give_the_samplers_tokens() -> None:
    """allowed_token_ids, one-token bad words, logit_bias and a min_tokens ban (active and
    run out), alone and beside a grammar, are served by the post-layer function with the
    eager path's tokens; each edit shows in the tokens; so is a bias on every token. A bad
    word of two tokens sends the step to the eager path, drawing nothing."""
    post = _post_layer()
    hidden = torch.randn(12, 16, generator=torch.Generator().manual_seed(4))
    rows = post.gather(hidden, np.array([2, 4, 6, 8, 10, 12]), torch.from_numpy)
    greedy = post.compute_logits(rows)[:6].argmax(dim=1).tolist()
    stop = greedy[3]  # row 3's favourite is its stop token while min_tokens holds
    specs = [
        {"temperature": 0.0, "allowed_token_ids": [3, 7, 41]},
        {"temperature": 0.0, "logit_bias": {11: 100.0, 12: -5.5}},
        {"temperature": 0.0, "bad_words_token_ids": [[greedy[2]], [greedy[2] ^ 1]]},
        {"temperature": 0.0, "min_tokens": 4, "stop_token_ids": [stop]},
        {"temperature": 0.9, "seed": 5, "logit_bias": {2: 3.0}, "allowed_token_ids": [2, 9]},
        {"temperature": 1.0, "top_k": 3, "min_tokens": 2, "stop_token_ids": [1, 2]},
    ]
    params = [SamplingParams(**spec) for spec in specs]
    for p in params:
        p.update_from_model([])
    states = [CachedRequestState(f"r{i}", [1, 2], p, [], 2, num_output_tokens=1)
              for i, p in enumerate(params)]
    rng = np.random.default_rng(3)
    grammar = GrammarOutput(["r0", "r4", "r5"],
                            rng.integers(-(2**31), 2**31, (3, 4), dtype=np.int32))
    reference = torch.Generator().manual_seed(0)
    for g in (None, grammar, None):
        got = post.sample(rows, states, g, [s.req_id for s in states])
        assert got is not None
        got = got.sampled_token_ids
        assert torch.equal(got, _eager_tokens(post, rows, states, g, reference)), g
        if g is None:
            assert got[0] in (3, 7, 41) and got[1] == 11 and got[2] != greedy[2]
            assert got[4] in (2, 9)
        # Output index 1: row 3's ban holds (min_tokens 4) and row 5's (2).
        assert got[3] != stop and got[5] not in (1, 2)
    states[3].num_output_tokens = 4  # min_tokens reached: the stop token is allowed again
    got = post.sample(rows, states, None, [s.req_id for s in states]).sampled_token_ids
    assert got[3] == stop
    assert torch.equal(got, _eager_tokens(post, rows, states, None, reference))
    seven = post.gather(hidden, np.arange(1, 8), torch.from_numpy)
    before = post.generator.get_state()
    two = SamplingParams(temperature=1.0, bad_words_token_ids=[[5, 6]])
    more = [*states, CachedRequestState("r6", [1], two, [], 1)]
    assert post.sample(seven, more, None, [s.req_id for s in more]) is None
    assert torch.equal(post.generator.get_state(), before)
    every = SamplingParams(temperature=0.0, logit_bias={t: (t % 7) - 3.0 for t in range(VOCAB)})
    more[-1] = CachedRequestState("r7", [1], every, [], 1)
    got = post.sample(seven, more, None, [s.req_id for s in more]).sampled_token_ids
    assert torch.equal(got, _eager_tokens(post, seven, more, None, reference))


def test_penalties_give_the_samplers_tokens_step_after_step() -> None:
    """Presence, frequency and repetition penalties over prompt and output tokens: step after
    step (the function keeps each slot's counts itself), after a token sampled elsewhere
    whose host copy has not landed (the slot is rebuilt, that token read on the device), and
    as requests leave and join (slots are reused), the post-layer tokens equal the eager
    path's, and the penalties show in them."""
    inflight: list[SimpleNamespace] = []
    tokens_of = SamplingInputs(torch.from_numpy, torch.Generator(), VOCAB, torch.device("cpu"),
                               lambda: inflight).penalty_history
    rebuilt: list[str] = []

    def history(states):
        rebuilt.extend(s.req_id for s in states)
        return tokens_of(states)

    post = _post_layer(max_rows=4, history=history)
    hidden = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    rows = post.gather(hidden, np.arange(1, 5), torch.from_numpy)
    favourite = post.compute_logits(rows)[:4].argmax(dim=1).tolist()
    specs = [
        {"temperature": 0.0, "frequency_penalty": 2.0},
        {"temperature": 0.0, "repetition_penalty": 1.8},
        # A bias, then penalties on the biased logits (the eager path's order).
        {"temperature": 0.9, "seed": 1, "presence_penalty": 1.5, "frequency_penalty": -0.5,
         "repetition_penalty": 1.5, "logit_bias": {favourite[2]: 3.0, 5: -4.0}},
        {"temperature": 0.0, "presence_penalty": 0.5},  # every slot taken: r4 reuses this
    ]
    prompts = [[1, 2], [favourite[1], 3, favourite[1]], [4], [5, 6, 7]]
    states = [CachedRequestState(f"r{i}", prompt, SamplingParams(**spec), [], len(prompt))
              for i, (prompt, spec) in enumerate(zip(prompts, specs))]
    reference = torch.Generator().manual_seed(0)
    for step in range(10):
        if step == 4:  # a token sampled elsewhere, still on the device: the count lags
            inflight.append(SimpleNamespace(
                states=[states[0]], positions=[states[0].num_output_tokens],
                device_token_ids=torch.tensor([favourite[0]])))
            states[0].num_output_tokens += 1
        if step == 5:  # its host copy lands
            states[0].output_token_ids.append(favourite[0])
            inflight.clear()
        if step == 6:  # a request leaves, a penalized one joins in its row
            states[3] = CachedRequestState("r4", [9, 9], SamplingParams(
                temperature=0.0, repetition_penalty=0.5, presence_penalty=-1.0), [], 2)
        if step == 8:  # the same request id with a new state (another prompt): rebuilt
            old = states[1]
            states[1] = CachedRequestState("r1", [0], old.sampling_params, [], 1,
                                           output_token_ids=list(old.output_token_ids),
                                           num_output_tokens=old.num_output_tokens)
        got = post.sample(rows, states, None, [s.req_id for s in states])
        assert got is not None
        got = got.sampled_token_ids
        want = _eager_tokens(post, rows, states, None, reference, lambda: inflight)
        assert torch.equal(got, want), step
        for state, token in zip(states, got.tolist()):
            state.output_token_ids.append(token)
            state.num_output_tokens += 1
    # Counts rebuilt only when they lag: every request's first step, r0 after its token
    # sampled elsewhere, r4 on joining, r1's new state.
    assert rebuilt == ["r0", "r1", "r2", "r3", "r0", "r4", "r1"]
    # The same hidden state each step: unpenalized, the same token; penalized, not.
    assert set(states[0].output_token_ids) != {favourite[0]}
    assert states[1].output_token_ids[0] != favourite[1]  # already in its prompt


# ---------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def llm():
    engine = LLM("demo-tiny", max_model_len=96, max_num_seqs=32, async_scheduling=True)
    yield engine
    engine.shutdown()


def _runner(llm):
    return llm.llm_engine.engine_core.model_executor.worker.model_runner


def _attach(llm, audits: list | None = None) -> PostLayer:
    """A PostLayer for the engine's runner (on a CPU the runner makes none itself)."""
    runner = _runner(llm)
    head = runner.model.compute_logits

    def compute_logits(hidden):
        if audits:  # the LM head is the model's: leave it out of the counts
            with audits[-1].paused():
                return head(hidden)
        return head(hidden)

    return PostLayer(compute_logits, runner.model.hidden_size, runner.dtype, runner.vocab_size,
                     runner.max_num_reqs, runner.device, runner.sampling_inputs.generator,
                     min_rows=runner.logits_min_rows,
                     history=runner.sampling_inputs.penalty_history,
                     to_device=runner.buffers.to_device)


def _generate(llm, post: PostLayer | None, prompts, params) -> list:
    runner = _runner(llm)
    runner.post_layer = post
    runner.sampling_inputs.generator.manual_seed(7)
    try:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        runner.post_layer = None


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU wiring; on CUDA the LM head's row count changes its kernels")
def test_engine_tokens_equal_the_eager_path(llm) -> None:
    """Greedy, random, top-k, top-p and min-p rows, with logit_bias, allowed_token_ids,
    min_tokens and penalties (counts rebuilt from tokens still on the device under async
    scheduling), give the eager path's tokens; a request with logprobs sends its steps to the
    eager path. (Grammars and bad words: the unit tests above; a schema's first compile takes
    seconds.)"""
    params = [
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0),
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, seed=3),
        # Short: top-k/top-p batches sort every row fully (about 20 ms a row on a CPU).
        SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, top_k=4, seed=1),
        SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, top_p=0.7, seed=4),
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, min_p=0.3, seed=5),
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0),
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=6,
                       logit_bias={5: 4.0, 9: -100.0}, allowed_token_ids=[5, 9, 17, 33]),
        SamplingParams(max_tokens=8, temperature=0.0, min_tokens=6),
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, frequency_penalty=1.5,
                       presence_penalty=0.5),
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=9,
                       repetition_penalty=1.3),
    ]
    prompts = [f"item {i}: " + "word " * i for i in range(len(params))]
    assert _runner(llm).reserved_bytes() == 0  # no graphs on a CPU: no request tables
    post = _attach(llm)
    used = []
    sample = post.sample
    post.sample = lambda *a, **k: used.append(sample(*a, **k)) or used[-1]
    want = _generate(llm, None, prompts, params)
    got = _generate(llm, post, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert any(u is not None for u in used)
    assert set(got[6].token_ids) <= {5, 17, 33} and len(got[7].token_ids) >= 6
    logprobs = [SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2),
                SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)]
    used.clear()
    got = _generate(llm, post, prompts[:2], logprobs)
    assert used and all(u is None for u in used)
    assert got[0].logprobs is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts CPU operations")
def test_engine_operations_outside_the_model_do_not_grow_with_the_batch(llm) -> None:
    """Decode steps at batch 1, 8 and 32 through the post-layer path: as many kernel
    launches outside the model (forward and LM head), none that would wait."""
    runner = _runner(llm)
    audits: list[OpAudit] = []
    post = _attach(llm, audits)
    execute, sample, run_model = runner.execute_model, runner.sample_tokens, runner._run_model
    steps: list[tuple[OpAudit, bool]] = []
    unsampled: list[OpAudit] = []  # executed steps are sampled oldest first

    def counted_execute(scheduler_output):
        audit = OpAudit("cpu")
        audits.append(audit)
        unsampled.append(audit)
        decode = (not scheduler_output.scheduled_new_reqs and
                  scheduler_output.total_num_scheduled_tokens
                  == len(scheduler_output.num_scheduled_tokens))
        steps.append((audit, decode))
        with audit:
            return execute(scheduler_output)

    def counted_sample(grammar_output):
        audit = unsampled.pop(0)
        audits.append(audit)  # the LM head pauses the newest audit
        with audit:
            return sample(grammar_output)

    def paused_model(*args, **kwargs):
        with audits[-1].paused():
            return run_model(*args, **kwargs)

    runner.execute_model, runner.sample_tokens = counted_execute, counted_sample
    runner._run_model = paused_model
    counts = {}
    try:
        for n in (1, 8, 32):
            steps.clear()
            params = [SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.8,
                                     seed=i if i % 2 else None) for i in range(n)]
            _generate(llm, post, [f"w {i}" for i in range(n)], params)
            decode = [audit for audit, is_decode in steps if is_decode]
            assert decode and all(a.syncs == [] for a in decode)
            # The last step also drops the finished rows.
            counts[n] = {len(a.launches) for a in decode[:-1]}
    finally:
        del runner.execute_model, runner.sample_tokens, runner._run_model
    assert counts[1] == counts[8] == counts[32] and len(counts[1]) == 1, counts


# ------------------------------------------------------------------------------ CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_graph_replays_equal_the_eager_function() -> None:
    """Every captured (size, plan, masked, edited) graph gives run()'s tokens,
    and sample() makes the host wait for nothing (torch's sync debug mode raises on a
    synchronisation), a slot's tables and a penalty rebuild included."""
    to_cuda = lambda a: torch.from_numpy(a).pin_memory().cuda(non_blocking=True)
    head = torch.nn.Linear(16, VOCAB, bias=False, device="cuda").requires_grad_(False)
    history = SamplingInputs(to_cuda, torch.Generator(), VOCAB, torch.device("cuda"),
                             list).penalty_history
    post = PostLayer(lambda h: head(h).float(), 16, torch.float32, VOCAB, 8,
                     torch.device("cuda"), torch.Generator().manual_seed(0), history=history)
    post.capture()
    assert len(post.graphs) == len(post.sizes) * len(Plan) * 4
    table = post.slots
    _fill_tables(table)
    mask = np.zeros((8, post.buffers.words), dtype=np.int32)
    mask[:, 2:] = -1  # the first 64 tokens forbidden
    for key, graph in post.graphs.items():
        size, plan, masked, _ = key
        table_rows = np.arange(size) * 2 + np.arange(size) % 2
        table_rows[-1] = 16  # the grammar's row reads the spare slot: tokens past 64 left
        post.buffers.stage(_params(size, plan.value, table_rows), [size - 1] if masked else [],
                           size, mask)
        post.buffers.wait_uploaded()  # the upload runs on the buffers' own stream
        post.hidden.normal_()
        counts = table.counts.clone()
        graph.replay()
        replayed = post.tokens[:size].clone()
        recorded = table.counts.clone()
        table.counts.copy_(counts)  # the eager run counts the same tokens again
        post.run(*key)
        post.buffers.mark_read()
        assert torch.equal(replayed, post.tokens[:size]), key
        assert torch.equal(recorded, table.counts), key
        if masked:
            assert int(replayed[size - 1]) >= 64
    states = [CachedRequestState(f"r{i}", [1], SamplingParams(temperature=t, seed=i), [], 1)
              for i, t in enumerate((0.0, 0.8, 1.0))]
    states.append(CachedRequestState("r3", [1, 2], SamplingParams(frequency_penalty=1.0),
                                     [], 2, output_token_ids=[5], num_output_tokens=1))
    edits = SamplingParams(logit_bias={4: 2.0}, allowed_token_ids=[4, 9], min_tokens=3,
                           stop_token_ids=[9])
    edits.update_from_model([])
    states.append(CachedRequestState("r4", [1], edits, [], 1, num_output_tokens=1))
    rows = post.gather(torch.randn(5, 16, device="cuda"), np.arange(1, 6), to_cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        post.sample(rows, states, None, [s.req_id for s in states])
    finally:
        torch.cuda.set_sync_debug_mode("default")


@cuda
def test_cuda_engine_decode_steps_never_sync_and_match_the_eager_path() -> None:
    """With decode graphs the runner samples decode steps from the post-layer graphs: the
    tokens equal the same function run eagerly (same shapes, so the same kernels), and no
    execute_model or sample_tokens call of a decode step makes the host wait (sync debug
    mode 'error')."""
    engine = LLM("demo-tiny", max_model_len=96, max_num_seqs=8, async_scheduling=True)
    try:
        runner = _runner(engine)
        post = runner.post_layer
        assert post is not None and post.graphs
        params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=t, top_k=k,
                                 seed=i) for i, (t, k) in enumerate(
                                     [(0.0, 0), (0.8, 0), (1.0, 5), (0.7, 0)])]
        # Penalty slots (rebuilt in a decode step, which must not wait) and bias entries.
        params += [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0,
                                  frequency_penalty=1.0, repetition_penalty=1.2),
                   SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=7,
                                  logit_bias={3: 5.0}, presence_penalty=0.5)]
        prompts = [f"item {i}: " + "word " * i for i in range(len(params))]
        graphs, post.graphs = post.graphs, {}
        want = _generate(engine, post, prompts, params)
        post.graphs = graphs
        execute, sample = runner.execute_model, runner.sample_tokens
        decode: list[bool] = []  # executed steps not sampled yet, oldest first

        def strict(call, is_decode: bool):
            torch.cuda.set_sync_debug_mode("error" if is_decode else "default")
            try:
                return call()
            finally:
                torch.cuda.set_sync_debug_mode("default")

        def checked_execute(so):
            decode.append(not so.scheduled_new_reqs
                          and so.total_num_scheduled_tokens == len(so.num_scheduled_tokens))
            return strict(lambda: execute(so), decode[-1])

        def checked_sample(grammar_output):
            return strict(lambda: sample(grammar_output), decode.pop(0))

        runner.execute_model, runner.sample_tokens = checked_execute, checked_sample
        try:
            got = _generate(engine, post, prompts, params)
        finally:
            del runner.execute_model, runner.sample_tokens
            runner.post_layer = post
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    finally:
        engine.shutdown()
