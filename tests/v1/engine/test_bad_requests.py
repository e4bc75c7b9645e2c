"""One request's bad inputs fail that request, never the engine core.

Requests arrive as EngineCoreRequests whose `sampling_params` values were written in
after SamplingParams checked them (as engine-side code could change them), or over the wire
with values SamplingParams refuses (as a client speaking the protocol directly could send). Each bad
request must finish with reason "error" and a message naming the problem; a normal request
in the same engine must still produce exactly its usual tokens; afterwards nothing is left
behind: no KV blocks, no scheduler entries, no grammar, no rows in the runner's persistent
batch. Covered for {sync, async} scheduling x {uni, mp} executors, and over the engine-core
process boundary (where a malformed message must not end the busy loop either).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import ErrorKind
from vllm.lora.request import LoRARequest
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.core_client import EngineCoreClient
from vllm.v1.engine.messages import RequestType
from vllm.v1.metrics.engine_stats import EngineCoreStats
from vllm.v1.request import Request

MODEL = "demo-tiny"
MAX_MODEL_LEN = 64
VOCAB_SIZE = 151936
PROMPT = [9707, 1879]
MAX_TOKENS = 6


def _params(**overrides: Any) -> SamplingParams:
    """A valid greedy request's params with `overrides` written in unchecked."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name, value in overrides.items():
        setattr(params, name, value)
    return params


def _request(
    req_id: str, prompt: list[int] | None = None, lora: LoRARequest | None = None,
    **overrides: Any,
) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=req_id,
        prompt_token_ids=list(PROMPT if prompt is None else prompt),
        sampling_params=_params(**overrides),
        arrival_time=time.monotonic(),
        lora_request=lora,
    )


# id -> (request, a fragment the error message must contain)
BAD_REQUESTS: dict[str, tuple[EngineCoreRequest, str]] = {
    "top_k_int32": (_request("top_k_int32", top_k=2**31), "top_k"),
    "seed_huge": (_request("seed_huge", seed=2**64), "seed"),
    "min_tokens_huge": (_request("min_tokens_huge", min_tokens=2**64), "min_tokens"),
    "min_tokens_huge_unbounded": (
        _request("min_tokens_huge_unbounded", min_tokens=2**64, max_tokens=None), "min_tokens"
    ),
    "max_tokens_huge": (_request("max_tokens_huge", max_tokens=2**70), "max_tokens"),
    "top_k_negative": (_request("top_k_negative", top_k=-5), "top_k"),
    "temperature_text": (_request("temperature_text", temperature="hot"), "temperature"),
    "temperature_huge": (_request("temperature_huge", temperature=1e300), "temperature"),
    "top_p_nan": (_request("top_p_nan", top_p=float("nan")), "top_p"),
    "penalty_inf": (_request("penalty_inf", repetition_penalty=float("inf")), "repetition_penalty"),
    "logprobs_huge": (_request("logprobs_huge", logprobs=10**6), "logprobs"),
    "stop_ids_huge": (_request("stop_ids_huge", stop_token_ids=[2**70]), "stop_token_ids"),
    # Parameters that are not a SamplingParams at all (the wire used to carry a dict).
    "not_params": (
        EngineCoreRequest("not_params", PROMPT, {"max_tokens": MAX_TOKENS}, time.monotonic()),
        "sampling_params",
    ),
    "bad_constraint": (
        _request("bad_constraint", structured_outputs={"json": 5}), "structured_outputs"
    ),
    "token_out_of_vocab": (_request("token_out_of_vocab", prompt=[1, VOCAB_SIZE]), "prompt"),
    "token_negative": (_request("token_negative", prompt=[-1, 5]), "prompt"),
    # Ids the sampler would index the logits with: one outside the vocabulary fails the step.
    "bias_out_of_vocab": (_request("bias_out_of_vocab", logit_bias={VOCAB_SIZE: 1.0}),
                          "logit_bias"),
    "allowed_out_of_vocab": (_request("allowed_out_of_vocab", allowed_token_ids=[VOCAB_SIZE]),
                             "allowed_token_ids"),
    "bad_word_out_of_vocab": (
        _request("bad_word_out_of_vocab", bad_words_token_ids=[[5, VOCAB_SIZE + 3]]), "bad_words"
    ),
    "prompt_empty": (_request("prompt_empty", prompt=[]), "prompt"),
    "prompt_too_long": (_request("prompt_too_long", prompt=[5] * MAX_MODEL_LEN), "prompt"),
    # This engine has no LoRA: its scheduler would wait forever for an adapter slot.
    "lora_disabled": (_request("lora_disabled", lora=LoRARequest("a", 1, "/nonexistent")),
                      "lora_request"),
}



def _mutated(req_id: str, **attrs: Any) -> Request:
    """A Request whose SamplingParams were changed after their validation (as engine-side
    code could do): only the engine core's own check stands between them and the runner."""
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name, value in attrs.items():
        setattr(params, name, value)
    return Request(req_id, PROMPT, params)


# The overflows of the issue, past SamplingParams: each one used to fail the whole step.
MUTATED_REQUESTS: dict[str, tuple[Request, str]] = {
    "mutated_top_k": (_mutated("mutated_top_k", top_k=2**31), "top_k"),
    "mutated_seed": (_mutated("mutated_seed", seed=2**64), "seed"),
    "mutated_min_tokens": (_mutated("mutated_min_tokens", min_tokens=2**64), "min_tokens"),
    "mutated_logprobs": (_mutated("mutated_logprobs", logprobs=VOCAB_SIZE + 1), "logprobs"),
    "mutated_temperature": (_mutated("mutated_temperature", temperature="hot"), "temperature"),
}

MODES = [(False, "uni"), (True, "uni"), (False, "mp"), (True, "mp")]


def _runner_state(worker: Any) -> tuple[int, int]:
    """(requests the runner remembers, rows in its persistent batch); runs on the worker."""
    runner = worker.model_runner
    return len(runner.requests), runner.input_batch.num_reqs


@pytest.fixture(scope="module", params=MODES, ids=lambda m: f"{'async' if m[0] else 'sync'}-{m[1]}")
def core(request: pytest.FixtureRequest) -> Iterator[EngineCore]:
    async_scheduling, backend = request.param
    config = EngineArgs(
        model=MODEL,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        num_gpu_blocks_override=64,
        async_scheduling=async_scheduling,
        distributed_executor_backend=backend,
    ).create_engine_config()
    engine = EngineCore(config)
    try:
        yield engine
    finally:
        engine.shutdown()


def _run_until_idle(core: EngineCore, max_calls: int = 500) -> dict[str, list[EngineCoreOutput]]:
    """Steps until the engine has nothing left to do; returns every output by request id."""
    outputs: dict[str, list[EngineCoreOutput]] = defaultdict(list)
    for _ in range(max_calls):
        if not core.has_work():
            return outputs
        step_outputs, _ = core.step_fn()
        for out in step_outputs or []:
            outputs[out.request_id].append(out)
    raise AssertionError(f"the engine still has work after {max_calls} steps")


def _tokens(outs: list[EngineCoreOutput]) -> list[int]:
    return [t for out in outs for t in out.new_token_ids]


def _assert_released(core: EngineCore) -> None:
    """Nothing of any request is left in the scheduler, the KV cache, grammars or the runner."""
    sched = core.scheduler
    assert sched.requests == {}
    assert not sched.waiting and not sched.running
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.usage == 0.0
    assert core.structured_output_manager.num_live_grammars == 0
    executor = core.model_executor
    if hasattr(executor, "worker"):
        states = [_runner_state(executor.worker)]
    else:
        states = executor.collective_rpc(_runner_state)
    assert all(state == (0, 0) for state in states), states


@pytest.fixture(scope="module")
def reference(core: EngineCore) -> list[int]:
    """The normal request's tokens when it runs alone in this engine."""
    core.add_request(_request("reference"))
    outputs = _run_until_idle(core)
    assert outputs["reference"][-1].finish_reason == "length"
    return _tokens(outputs["reference"])


def test_bad_requests_fail_alone(core: EngineCore, reference: list[int]) -> None:
    # One normal request is already running (and, under async scheduling, in flight) when
    # the bad ones arrive; another arrives after them.
    core.add_request(_request("before"))
    first, _ = core.step_fn()
    for req, _ in BAD_REQUESTS.values():
        core.add_request(req)
    for bad, _ in MUTATED_REQUESTS.values():
        core.add_request(bad)
    core.add_request(_request("after"))
    outputs = _run_until_idle(core)
    for out in first or []:
        outputs[out.request_id].insert(0, out)

    for req_id, (_, fragment) in [*BAD_REQUESTS.items(), *MUTATED_REQUESTS.items()]:
        outs = outputs.get(req_id)
        assert outs is not None and len(outs) == 1, (req_id, outs)
        assert outs[0].finish_reason == "error", (req_id, outs[0])
        assert outs[0].new_token_ids == []
        assert outs[0].error and fragment in outs[0].error, (req_id, outs[0].error)
        # Typed by the check that refused it: bad values are the client's fault; a payload
        # that does not even build SamplingParams can only come from a broken front end.
        kind = ErrorKind.INTERNAL if req_id == "not_params" else ErrorKind.INVALID_REQUEST
        assert outs[0].error_kind is kind, (req_id, outs[0])
    for req_id in ("before", "after"):
        assert _tokens(outputs[req_id]) == reference, req_id
        assert outputs[req_id][-1].finish_reason == "length"
    _assert_released(core)


def test_duplicate_request_id_ends_that_id_only(core: EngineCore, reference: list[int]) -> None:
    core.add_request(_request("dup"))
    core.add_request(_request("other"))
    first, _ = core.step_fn()
    core.add_request(_request("dup"))
    outputs = _run_until_idle(core)
    for out in first or []:
        outputs[out.request_id].insert(0, out)
    # The id is ambiguous now: the engine ends it (once) with an error and frees its state.
    finished = [out for out in outputs["dup"] if out.finished]
    assert len(finished) == 1 and finished[0].finish_reason == "error"
    assert "dup" in (finished[0].error or "")
    assert finished[0].error_kind is ErrorKind.INVALID_REQUEST
    assert outputs["dup"][-1] is finished[0]
    assert _tokens(outputs["other"]) == reference
    _assert_released(core)


def test_a_normal_request_still_runs_afterwards(core: EngineCore, reference: list[int]) -> None:
    core.add_request(_request("last"))
    outputs = _run_until_idle(core)
    assert _tokens(outputs["last"]) == reference
    _assert_released(core)


# ---------------------------------------------------------------------- process boundary


class _Collector:
    def __init__(self) -> None:
        self.outputs: dict[str, list[EngineCoreOutput]] = defaultdict(list)
        self.stats: list[EngineCoreStats] = []
        self.dead: list[str] = []
        self.changed = asyncio.Event()

    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs:
            self.outputs[out.request_id].append(out)
        self.changed.set()

    def on_stats(self, stats: EngineCoreStats) -> None:
        self.stats.append(stats)
        self.changed.set()

    def on_dead(self, reason: str) -> None:
        self.dead.append(reason)
        self.changed.set()

    def finished(self, req_id: str) -> bool:
        return any(out.finished for out in self.outputs.get(req_id, []))

    async def wait_for(self, predicate, timeout_s: float = 60.0) -> None:
        async def loop() -> None:
            while not predicate() and not self.dead:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(loop(), timeout_s)


def test_engine_core_process_survives_bad_requests_and_messages() -> None:
    config = EngineArgs(
        model=MODEL, max_model_len=MAX_MODEL_LEN, async_scheduling=True
    ).create_engine_config()
    client = EngineCoreClient(config)
    encoder = msgspec.msgpack.Encoder()

    async def run() -> _Collector:
        col = _Collector()
        client.start(col.on_outputs, col.on_stats, col.on_dead)
        client.add_request(_request("good-0", max_tokens=40))
        # Values the wire can carry that the runner cannot store.
        client.add_request(_request("top_k", top_k=2**31))
        client.add_request(_request("min_tokens", min_tokens=2**63, max_tokens=None))
        # An add whose fields have the wrong types, one whose parameters have a field
        # SamplingParams does not know, and one that is not msgpack at all.
        client._send(RequestType.ADD, encoder.encode(["wrong-types", [1, 2], "params", 0.0]))
        client._send(RequestType.ADD, encoder.encode(
            ["unknown-field", PROMPT, {"max_tokens": MAX_TOKENS, "bogus": 1}, 0.0]))
        client._send(RequestType.ADD, b"\xc1 not msgpack")
        client._send(RequestType.ABORT, b"\xc1 not msgpack")
        client.add_request(_request("good-1"))
        await col.wait_for(
            lambda: all(col.finished(r) for r in ("good-0", "good-1", "top_k", "min_tokens",
                                                  "wrong-types", "unknown-field"))
        )
        await col.wait_for(
            lambda: bool(col.stats) and col.stats[-1].num_running == 0
            and col.stats[-1].num_waiting == 0
        )
        return col

    try:
        col = asyncio.run(run())
        assert col.dead == []
        for req_id in ("top_k", "min_tokens", "wrong-types", "unknown-field"):
            (out,) = col.outputs[req_id]
            assert out.finish_reason == "error" and out.error, (req_id, out)
        # Values SamplingParams refuses are the client's fault on this side of the wire too
        # (the message names the field); a payload no front end could build is an engine bug.
        for req_id in ("top_k", "min_tokens"):
            (out,) = col.outputs[req_id]
            assert out.error_kind is ErrorKind.INVALID_REQUEST and req_id in out.error, out
        for req_id in ("wrong-types", "unknown-field"):
            (out,) = col.outputs[req_id]
            assert out.error_kind is ErrorKind.INTERNAL, out
        assert "bogus" in col.outputs["unknown-field"][0].error
        assert col.outputs["good-0"][-1].finish_reason == "length"
        assert len(_tokens(col.outputs["good-0"])) == 40
        assert col.outputs["good-1"][-1].finish_reason == "length"
        assert len(_tokens(col.outputs["good-1"])) == MAX_TOKENS
        last = col.stats[-1]
        assert last.kv.num_free_blocks == last.kv.num_blocks and last.kv.usage == 0.0
        assert client.dead_reason is None
    finally:
        client.shutdown()


# ---------------------------------------------------------------------- offline engine


def test_offline_engine_reports_the_error_and_keeps_serving() -> None:
    from vllm import LLM

    llm = LLM(MODEL, max_model_len=MAX_MODEL_LEN)
    try:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        # The engine request carries its own parameters: the overflow goes in there.
        engine.add_processed_request(None, _request("bad", top_k=2**31), params)
        engine.add_processed_request(None, _request("good"), params)
        finished = {}
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0]
        assert finished["bad"].finish_reason == "error"
        assert "top_k" in (finished["bad"].error or "")
        assert finished["good"].finish_reason == "length"
        assert len(finished["good"].token_ids) == MAX_TOKENS
        assert engine.engine_core.scheduler.requests == {}
    finally:
        llm.shutdown()
