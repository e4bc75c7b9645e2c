"""Shared fakes for scheduler and engine-loop tests: configs, requests, a fake model runner
that checks what the scheduler tells it, and a token-level fake grammar backend."""

from __future__ import annotations

import contextlib

import copy
import random
import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from vllm.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.spec_decode.proposer import build_proposer
from vllm.v1.structured_output.backends.auto import AutoBackend
from vllm.v1.structured_output.manager import StructuredOutputManager
from vllm.v1.structured_output.backends.base import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
)

EOS = 151_645  # the demo model's <|im_end|>
EOS_IDS = [151_645, 151_643]  # the demo model's generation EOS ids
# The token a FakeGrammar's bitmask leads the FakeRunner to at the end of its sequence.
GRAMMAR_END = min(EOS_IDS)

# (request id, output index k) -> the token the fake model "samples" as that output.
TokenPolicy = Callable[[str, int], int]


def default_policy(req_id: str, k: int) -> int:
    """A token that is never a stop token: distinct per output index."""
    return 1000 + k


def demo_model_config() -> ModelConfig:
    """The ModelConfig of the cheap demo model (built and cached on first use)."""
    from vllm.model_executor.model_loader.demo_model import build_demo_model

    return ModelConfig(model=str(build_demo_model("demo-tiny")))


def make_config(
    model_config: ModelConfig,
    *,
    max_model_len: int = 64,
    block_size: int = 4,
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    async_scheduling: bool = False,
    enable_prefix_caching: bool = True,
    pipeline_parallel_size: int = 1,
    num_speculative_tokens: int = 0,
    scheduling_policy: str = "fcfs",
) -> VllmConfig:
    """A VllmConfig over a copy of `model_config` with the given scheduler and cache sizes."""
    mc = copy.copy(model_config)
    mc.max_model_len = max_model_len
    return VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            num_gpu_blocks_override=num_blocks,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            async_scheduling=async_scheduling,
            policy=scheduling_policy,
        ),
        parallel_config=ParallelConfig(pipeline_parallel_size=pipeline_parallel_size),
        speculative_config=(
            SpeculativeConfig(num_speculative_tokens=num_speculative_tokens)
            if num_speculative_tokens else None
        ),
    )


def make_kv(config: VllmConfig) -> KVCacheManager:
    """A real KVCacheManager sized by the config's cache part."""
    cache = config.cache_config
    assert cache.num_gpu_blocks_override is not None
    return KVCacheManager(
        cache.num_gpu_blocks_override, cache.block_size, cache.enable_prefix_caching
    )


def make_request(
    req_id: str,
    prompt: list[int] | int,
    *,
    eos_ids: list[int] | None = None,
    grammar: str | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
    mm_features: list | None = None,
    **params: object,
) -> Request:
    """A Request whose stop ids are set the way the engine sets them.

    `prompt` may be a length (tokens 1..n, distinct per request) or a token list; `grammar`
    is a FakeBackend spec (space-separated token ids the output must follow); `priority`,
    `cache_salt` and `mm_features` (its images) are the Request's own.
    """
    if isinstance(prompt, int):
        # Distinct per request id, so that prompts share no prefix-cache blocks by accident.
        base = 2000 + 64 * (zlib.crc32(req_id.encode()) % 2000)
        prompt = [base + i for i in range(prompt)]
    if grammar is not None:
        params["structured_outputs"] = StructuredOutputsParams(regex=grammar)
    sp = SamplingParams(temperature=0.0, **params)  # type: ignore[arg-type]
    sp.update_from_model(EOS_IDS if eos_ids is None else eos_ids)
    return Request(req_id, prompt, sp, priority=priority, cache_salt=cache_salt,
                   mm_features=mm_features)


def random_specs(
    seed: int, num_requests: int, max_prompt: int
) -> tuple[list[tuple[str, int, dict]], dict[str, dict[int, int]]]:
    """A seeded mixed workload for make_request: (id, prompt length, kwargs) per request,
    every other one with a grammar, plus {id: {output index: EOS}} for some of the rest (a
    policy override that ends them early)."""
    rng = random.Random(seed)
    specs, special = [], {}
    for i in range(num_requests):
        req_id, max_tokens = f"q{i}", rng.randint(1, 10)
        kwargs: dict = {"max_tokens": max_tokens}
        if i % 2 == 0:
            kwargs["grammar"] = " ".join(str(rng.randint(1, 500)) for _ in range(rng.randint(1, 6)))
        elif max_tokens > 2:
            special[req_id] = {rng.randint(0, max_tokens - 1): EOS}
        specs.append((req_id, rng.randint(1, max_prompt), kwargs))
    return specs, special


def pool_is_full(kv: KVCacheManager) -> bool:
    """True when no request owns a block."""
    return kv.num_free_blocks == kv.num_blocks and all(
        b.ref_cnt == 0 for b in kv.pool.blocks
    )


def first_allowed(bitmask: np.ndarray, row: int) -> int:
    """The lowest token id allowed by `bitmask[row]`. Raises ValueError if none is."""
    words = bitmask[row].view(np.uint32)
    nz = np.flatnonzero(words)
    if len(nz) == 0:
        raise ValueError(f"bitmask row {row} allows no token")
    w = int(nz[0])
    word = int(words[w])
    return 32 * w + (word & -word).bit_length() - 1


# ---------------------------------------------------------------------- speculative decoding

CYCLE = [300, 301, 302, 303]


def cyclic(req_id: str, k: int) -> int:
    """Continues CYCLE (every prompt below is CYCLE repeated), except that requests named
    "x..." break the cycle every fifth output, so some of their drafts are rejected."""
    if req_id.startswith("x") and k % 5 == 4:
        return 900 + k
    return CYCLE[k % len(CYCLE)]


def spec_workload() -> list[Request]:
    """Requests whose outputs (under `cyclic`) make n-gram drafts pay, mostly."""
    prompt = CYCLE * 3
    return [
        make_request("a", prompt, max_tokens=14),
        make_request("x1", prompt, max_tokens=17, ignore_eos=True),
        make_request("short", prompt, max_tokens=2),
        # The grammar follows the cycle, then leaves it: drafts past the turn are cut (it
        # may stop anywhere, so nothing is fast-forwarded before its end).
        make_request("g", prompt, max_tokens=12, grammar="?300 301 302 303 300 301 7 8"),
        make_request("x2", prompt[:6], max_tokens=9),
    ]


# Scheduler settings the speculative-decoding tests run under: few blocks force
# preemption, a small budget chunks the prompts.
SPEC_CONDITIONS: dict[str, dict] = {
    "plain": {},
    "preemption": dict(num_blocks=14),
    "chunked": dict(max_num_batched_tokens=8),
}


# ---------------------------------------------------------------------- fake model runner


@dataclass
class _RunnerReq:
    """What the fake runner knows about one request (as a real runner would)."""

    num_computed: int
    num_blocks: int
    # Verified with drafts since its last forward: the scheduler may have scheduled the
    # next one assuming every draft was kept (the real runner's verified_drafts).
    verified: bool = False


@dataclass
class FakeRunner:
    """Turns SchedulerOutputs into ModelRunnerOutputs, checking the scheduler's bookkeeping.

    Output k of a request is `policy(req_id, k)`, except that a request named in the step's
    GrammarOutput gets the lowest token its bitmask row allows, and `force[(req_id, k)]`
    overrides both; fast-forward tokens (the step's num_fast_forward_tokens) are output as
    drafted. Counting k continues across preemption (it is the index of the output
    token). Drafts are verified as the real runner does: the output at each drafted position
    is chosen the same way, and drafts are kept while they equal it. Raises AssertionError when a SchedulerOutput contradicts what the runner was told
    before (computed-token counts, block counts, unknown requests).
    """

    block_size: int
    policy: TokenPolicy = default_policy
    force: dict[tuple[str, int], int] = field(default_factory=dict)
    reqs: dict[str, _RunnerReq] = field(default_factory=dict)
    num_sampled: dict[str, int] = field(default_factory=dict)
    # Every step the runner saw, in order.
    steps: list[SchedulerOutput] = field(default_factory=list)
    # Pipeline parallelism: the runner learns tokens only from new_token_ids, which must
    # carry exactly the outputs it has not been told about (checked at every execute).
    pipelined: bool = False
    sampled_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_told: dict[str, int] = field(default_factory=dict)

    def execute(self, scheduler_output: SchedulerOutput) -> None:
        """Applies one step's state changes, as the runner's execute_model would."""
        self.steps.append(scheduler_output)
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.reqs.pop(req_id, None)
            assert req_id not in scheduler_output.num_scheduled_tokens, f"{req_id} scheduled and dropped"
        for req_id, kept in scheduler_output.num_kept_blocks.items():
            if req_id in self.reqs:
                assert kept <= self.reqs[req_id].num_blocks, (req_id, kept)
                self.reqs[req_id].num_blocks = kept
        for new in scheduler_output.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent as new twice"
            assert new.num_computed_tokens % self.block_size == 0
            self.reqs[new.req_id] = _RunnerReq(new.num_computed_tokens, len(new.block_ids))
            self.num_told[new.req_id] = 0
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if cached.resumed_from_preemption[i]:
                assert req_id not in self.reqs, f"{req_id} resumed but never dropped"
                assert req_id in cached.resumed_req_token_ids
                self.reqs[req_id] = _RunnerReq(
                    cached.num_computed_tokens[i], len(cached.new_block_ids[i])
                )
                self.num_told[req_id] = cached.resumed_num_output_tokens[req_id]
                continue
            if self.pipelined:
                sampled = self.sampled_tokens.get(req_id, [])
                told = self.num_told[req_id]
                assert cached.new_token_ids.get(req_id, []) == sampled[told:], (
                    req_id, cached.new_token_ids.get(req_id), sampled[told:])
                self.num_told[req_id] = len(sampled)
            else:
                assert not cached.new_token_ids, "new_token_ids sent without pipeline stages"
            assert req_id not in cached.resumed_req_token_ids
            state = self.reqs[req_id]
            # After a verification the scheduler may count every draft as kept.
            agrees = (cached.num_computed_tokens[i] >= state.num_computed if state.verified
                      else cached.num_computed_tokens[i] == state.num_computed)
            assert agrees, (
                f"{req_id}: scheduler says {cached.num_computed_tokens[i]} computed, "
                f"runner has {state.num_computed}"
            )
            state.verified = False
            state.num_blocks += len(cached.new_block_ids[i])
        assert scheduler_output.total_num_scheduled_tokens == sum(scheduler_output.num_scheduled_tokens.values())
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            assert n > 0
            state = self.reqs[req_id]
            state.num_computed += n
            needed = -(-state.num_computed // self.block_size)
            assert state.num_blocks >= needed, (
                f"{req_id}: {state.num_blocks} blocks for {state.num_computed} tokens"
            )
        assert set(scheduler_output.sampled_req_ids) <= set(scheduler_output.num_scheduled_tokens)

    def sample(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        """The tokens of `scheduler_output` (call after its execute, in step order)."""
        rows: dict[str, int] = {}
        if grammar_output is not None:
            ids = grammar_output.structured_output_request_ids
            assert grammar_output.grammar_bitmask.shape[0] == len(ids)
            for i, r in enumerate(ids):
                rows.setdefault(r, i)  # a request's draft rows follow its first
        spec = scheduler_output.scheduled_spec_decode_tokens
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = set(scheduler_output.sampled_req_ids)
        tokens: list[list[int]] = []
        for req_id in req_ids:
            if req_id not in sampled:
                tokens.append([])
                continue
            k = self.num_sampled.get(req_id, 0)
            drafts = spec.get(req_id, [])
            # Fast-forward tokens are kept as they are, and have no bitmask row.
            certain = scheduler_output.num_fast_forward_tokens.get(req_id, 0)
            kept: list[int] = []
            for j in range(len(drafts) + 1):
                if j < certain:
                    token = drafts[j]
                elif (req_id, k + j) in self.force:
                    token = self.force[(req_id, k + j)]
                elif req_id in rows:
                    assert grammar_output is not None
                    token = first_allowed(grammar_output.grammar_bitmask,
                                          rows[req_id] + j - certain)
                else:
                    token = self.policy(req_id, k + j)
                kept.append(token)
                if j == len(drafts) or token != drafts[j]:
                    break
            self.num_sampled[req_id] = k + len(kept)
            rejected = len(drafts) - (len(kept) - 1)
            if drafts and req_id in self.reqs:
                self.reqs[req_id].num_computed -= rejected  # their KV is computed again
                self.reqs[req_id].verified = True
            tokens.append(kept)
            self.sampled_tokens.setdefault(req_id, []).extend(kept)
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=tokens,
        )

    def run(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        """execute + sample of one step."""
        self.execute(scheduler_output)
        return self.sample(scheduler_output, grammar_output)


# ---------------------------------------------------------------------- fake grammar


class FakeGrammar(StructuredOutputGrammar):
    """Accepts exactly `seq` followed by one stop token; rejects anything else. With
    `jump_forward`, it reports the rest of `seq` as forced tokens. With `may_stop`, a stop
    token is also allowed before the end of `seq` (so no position but the last allows a
    single token: exact fast-forward appends nothing before it)."""

    def __init__(self, seq: list[int], stop_ids: list[int], vocab_size: int,
                 jump_forward: bool = False, may_stop: bool = False) -> None:
        self.seq = seq
        self.stop_ids = stop_ids
        self.vocab_size = vocab_size
        self.jump_forward = jump_forward
        self.may_stop = may_stop
        self.accepted: list[int] = []
        self.terminated = False

    def jump_forward_tokens(self) -> list[int]:
        return self.seq[len(self.accepted):] if self.jump_forward else []

    def _ok(self, token: int) -> bool:
        pos = len(self.accepted)
        if self.terminated:
            return False
        if pos < len(self.seq):
            return token == self.seq[pos] or (self.may_stop and token in self.stop_ids)
        return token in self.stop_ids

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Accepts tokens in order; False at the first one not allowed."""
        for token in tokens:
            if not self._ok(token):
                return False
            if len(self.accepted) == len(self.seq) or token in self.stop_ids:
                self.terminated = True
            self.accepted.append(token)
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest acceptable prefix of `tokens`."""
        probe = FakeGrammar(self.seq, self.stop_ids, self.vocab_size,
                            may_stop=self.may_stop)
        probe.accepted, probe.terminated = list(self.accepted), self.terminated
        out: list[int] = []
        for token in tokens:
            if not probe.accept_tokens("", [token]):
                break
            out.append(token)
        return out

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` tokens. Raises ValueError if too many."""
        if not 0 <= num_tokens <= len(self.accepted):
            raise ValueError(f"rollback: cannot undo {num_tokens} tokens")
        if num_tokens:
            del self.accepted[-num_tokens:]
            self.terminated = False

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Allows the next token of `seq`, or the stop tokens at its end."""
        if self.terminated:
            bitmask[row] = -1
            return
        bitmask[row] = 0
        pos = len(self.accepted)
        allowed = [self.seq[pos]] if pos < len(self.seq) else list(self.stop_ids)
        if self.may_stop and pos < len(self.seq):
            allowed += self.stop_ids
        view = bitmask[row].view(np.uint32)
        for token in allowed:
            view[token // 32] |= np.uint32(1 << (token % 32))

    def is_terminated(self) -> bool:
        return self.terminated

    @property
    def num_processed_tokens(self) -> int:
        return len(self.accepted)


class FakeBackend(StructuredOutputBackend):
    """Compiles `regex` specs of space-separated token ids into FakeGrammars ("!" first:
    one that reports its forced tokens; "?" first: one that may stop anywhere).

    The spec "fail" raises ValueError, like an invalid constraint.
    """

    def __init__(self, vocab_size: int, stop_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids

    def compile_grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        spec = params.regex or ""
        if spec == "fail":
            raise ValueError("structured_outputs.regex: the fake backend refuses 'fail'")
        forced, may_stop = spec.startswith("!"), spec.startswith("?")
        return FakeGrammar([int(t) for t in spec.lstrip("!?").split()], self.stop_ids,
                           self.vocab_size, jump_forward=forced, may_stop=may_stop)


class FakeStructuredOutputManager(StructuredOutputManager):
    """The real manager (thread-pool compile, bitmask buffers) over the FakeBackend."""

    def _create_backend(self) -> AutoBackend:
        fake = FakeBackend(self._vocab_size, self._stop_token_ids)
        return AutoBackend(self._vocab_size, [("fake", lambda: fake)])


def wait_compiled(request: Request) -> None:
    """Blocks until the request's grammar compile job (if any) has finished."""
    structured_req = request.structured_output_request
    if structured_req is not None and structured_req.future is not None:
        structured_req.future.exception(timeout=30)


# ---------------------------------------------------------------------- driving a scheduler


@dataclass
class InFlight:
    """A scheduled step whose output has not been given to update_from_output yet."""

    scheduler_output: SchedulerOutput
    # The requests that sample in the step (an id may be reused by a new request meanwhile).
    sampled: dict[str, Request] = field(default_factory=dict)
    # None while sampling is deferred until every older step has been updated.
    output: ModelRunnerOutput | None = None

    def samples(self, request: Request | None) -> bool:
        """Whether `request` (this very request, not another of its id) samples here."""
        return request is not None and self.sampled.get(request.request_id) is request


@dataclass
class Harness:
    """Drives a scheduler with a FakeRunner the way the engine does, with up to `depth` steps
    in flight, and checks the scheduler's invariants after every call.

    Records per request: tokens scheduled in total, steps it was scheduled in, output tokens
    and EngineCoreOutputs.
    """

    sched: Scheduler
    runner: FakeRunner
    depth: int = 1
    in_flight: deque[InFlight] = field(default_factory=deque)
    scheduled: Counter[str] = field(default_factory=Counter)
    steps_of: dict[str, list[int]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    outputs: dict[str, list[EngineCoreOutput]] = field(default_factory=dict)
    # Every request ever added, by id (finished ones included).
    added: dict[str, Request] = field(default_factory=dict)

    @property
    def kv(self) -> KVCacheManager:
        return self.sched.kv_cache_manager

    def add(self, *requests: Request) -> None:
        """Adds requests and waits for their grammars to compile."""
        for request in requests:
            self.added[request.request_id] = request
            self.sched.add_request(request)
            wait_compiled(request)

    def in_flight_samples(self, req_id: str) -> int:
        """Steps in flight that sample the live request `req_id`."""
        request = self.sched.requests.get(req_id)
        return sum(e.samples(request) for e in self.in_flight)

    def tokens_in_flight(self, req_id: str) -> int:
        """The most tokens the steps in flight can still give the live request `req_id`: one
        per step that samples it, plus that step's drafts."""
        request = self.sched.requests.get(req_id)
        return sum(
            1 + len(e.scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            for e in self.in_flight if e.samples(request)
        )

    def schedule(self) -> SchedulerOutput:
        """Schedules one step; launches it unless it is empty (then its finished ids are
        handed back to the scheduler, as the engine does)."""
        sched = self.sched
        scheduler_output = sched.schedule()
        waiting_for_token = {
            r for r in scheduler_output.num_scheduled_tokens
            if self.in_flight_samples(r) and self.added[r].use_structured_output
        }
        assert scheduler_output.pending_structured_output_tokens == bool(waiting_for_token), (
            scheduler_output.pending_structured_output_tokens, waiting_for_token)
        if any(self.added[r].use_structured_output for r in scheduler_output.sampled_req_ids):
            assert scheduler_output.has_structured_output_requests
        # The runner feeds a request's previous token from the device, so a request must not
        # be scheduled while a step that samples it has not been sampled.
        unsampled = {
            r for e in self.in_flight if e.output is None
            for r in e.scheduler_output.sampled_req_ids
        }
        assert not unsampled & set(scheduler_output.num_scheduled_tokens), (
            "scheduled before its previous token was sampled",
            unsampled & set(scheduler_output.num_scheduled_tokens))
        if scheduler_output.total_num_scheduled_tokens == 0:
            sched.unschedule(scheduler_output)
            self.check()
            return scheduler_output
        self.runner.execute(scheduler_output)
        sampled = {r: sched.requests[r] for r in scheduler_output.sampled_req_ids}
        self.in_flight.append(InFlight(scheduler_output, sampled))
        self.sample_ready()
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            self.scheduled[req_id] += n
            self.steps_of.setdefault(req_id, []).append(scheduler_output.step_id)
        self.check()
        return scheduler_output

    def sample_ready(self) -> None:
        """Samples in-flight steps in order, as the engine's batch queue does: a step whose
        structured requests have a token in flight only once it is the oldest (every older
        step updated), any other step at once, but never before an older step."""
        for position, entry in enumerate(self.in_flight):
            if entry.output is not None:
                continue
            scheduler_output = entry.scheduler_output
            if scheduler_output.pending_structured_output_tokens and position > 0:
                return
            entry.output = self.runner.sample(
                scheduler_output, self.sched.get_grammar_bitmask(scheduler_output))
            self.sched.sampling_issued(scheduler_output)

    def update(self) -> list[EngineCoreOutput]:
        """Gives the oldest in-flight step's output to update_from_output."""
        self.sample_ready()  # the oldest step can always be sampled
        entry = self.in_flight.popleft()
        assert entry.output is not None
        outs = self.sched.update_from_output(entry.scheduler_output, entry.output)
        self.sample_ready()
        for out in outs:
            self.outputs.setdefault(out.request_id, []).append(out)
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        self.check()
        return outs

    def step(self) -> bool:
        """One engine iteration: schedule if there is room, update when the queue is full or
        nothing more could be scheduled. Returns False when nothing is left to do."""
        sched = self.sched
        launched = False
        if sched.has_unfinished_requests() and len(self.in_flight) < self.depth:
            before = len(self.in_flight)
            self.schedule()
            launched = len(self.in_flight) > before
        if self.in_flight and (len(self.in_flight) >= self.depth or not launched):
            self.update()
        return sched.has_unfinished_requests() or bool(self.in_flight)

    def run(self, max_steps: int = 500) -> None:
        """Steps until every request has finished and nothing is in flight."""
        for _ in range(max_steps):
            if not self.step():
                return
        raise AssertionError(f"not done after {max_steps} steps")

    def drain(self) -> None:
        """Updates every step in flight."""
        while self.in_flight:
            self.update()

    def finish_reason(self, req_id: str) -> str | None:
        """Finish reason of the request's last output (None if it never finished)."""
        outs = self.outputs.get(req_id, [])
        return outs[-1].finish_reason if outs else None

    def check(self) -> None:
        """Invariants that hold between any two scheduler calls."""
        sched = self.sched
        is_async = isinstance(sched, AsyncScheduler)
        running = {r.request_id for r in sched.running}
        waiting = {r.request_id for r in sched.waiting}
        assert len(running) == len(sched.running) and len(waiting) == len(sched.waiting)
        assert not running & waiting
        assert running | waiting == set(sched.requests), "a live request is lost or leaked"
        assert len(sched.running) <= sched.max_num_seqs
        for req_id, request in sched.requests.items():
            assert not request.is_finished()
            if req_id in running:
                assert request.status == RequestStatus.RUNNING
            else:
                assert request.status in (
                    RequestStatus.WAITING, RequestStatus.WAITING_FOR_FSM,
                    RequestStatus.PREEMPTED,
                )
            assert request.num_output_placeholders >= 0
            # Under async scheduling every in-flight sample is a placeholder, and so is each
            # draft in flight (a verification may keep them all), and nothing else is; the
            # sync scheduler never has any.
            want = self.tokens_in_flight(req_id) if is_async else 0
            assert request.num_output_placeholders == want, (
                req_id, request.num_output_placeholders, want)
            drafts_in_flight = 0 if is_async else sum(
                len(e.scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
                for e in self.in_flight
            )
            assert request.num_computed_tokens <= (
                request.num_tokens + request.num_output_placeholders + drafts_in_flight
            )
        owners: Counter[int] = Counter()
        for req_id in sched.requests:
            ids = self.kv.get_block_ids(req_id)
            assert len(set(ids)) == len(ids)
            owners.update(ids)
        for block in self.kv.pool.blocks:
            assert block.ref_cnt == owners[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                f"owned by {owners[block.block_id]} live requests"
            )
        for req_id in set(self.added) - set(sched.requests):
            assert self.kv.get_block_ids(req_id) == [], f"finished {req_id} still owns blocks"


def build_harness(
    model_config: ModelConfig,
    *,
    async_scheduling: bool = False,
    depth: int | None = None,
    policy: TokenPolicy = default_policy,
    **config: object,
) -> tuple[Harness, FakeStructuredOutputManager]:
    """A scheduler (AsyncScheduler when async_scheduling) over a real KVCacheManager and the
    fake-grammar StructuredOutputManager, driven by a Harness of `depth` steps in flight
    (default: 2 under async scheduling, else 1). `config` goes to make_config."""
    vllm_config = make_config(
        model_config, async_scheduling=async_scheduling, **config  # type: ignore[arg-type]
    )
    kv = make_kv(vllm_config)
    som = FakeStructuredOutputManager(vllm_config)
    # As in EngineCore: pipeline stages always overlap steps, so they need in-flight tokens
    # counted.
    pipelined = vllm_config.parallel_config.pipeline_parallel_size > 1
    cls = AsyncScheduler if async_scheduling or pipelined else Scheduler
    sched = cls(vllm_config, kv, som, build_proposer(vllm_config))
    if depth is None:
        depth = 2 if async_scheduling else 1
    runner = FakeRunner(vllm_config.cache_config.block_size, policy)
    runner.pipelined = vllm_config.parallel_config.pipeline_parallel_size > 1
    return Harness(sched, runner, depth), som


def assert_all_released(harness: Harness, som: StructuredOutputManager) -> None:
    """Teardown check: no live request, nothing in flight, every block free, no grammar."""
    sched = harness.sched
    assert not harness.in_flight, "steps left in flight"
    assert not sched.requests and not sched.running and not sched.waiting
    assert pool_is_full(harness.kv), (
        f"{harness.kv.num_blocks - harness.kv.num_free_blocks} KV blocks leaked"
    )
    assert som.num_live_grammars == 0


MakeHarness = Callable[..., "Harness"]  # what harness_factory yields


@contextlib.contextmanager
def harness_factory(
    model_config: ModelConfig, **defaults: object
) -> Iterator[Callable[..., Harness]]:
    """Yields a function building harnesses (keyword arguments override `defaults`); on exit
    asserts that every harness released every request, block and grammar."""
    made = []

    def make(**kwargs: object) -> Harness:
        harness, som = build_harness(model_config, **{**defaults, **kwargs})  # type: ignore[arg-type]
        made.append((harness, som))
        return harness

    try:
        yield make
        for harness, som in made:
            assert_all_released(harness, som)
    finally:
        for _, som in made:
            som.shutdown()
