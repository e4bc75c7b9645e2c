"""AsyncLLM: streaming outputs from an engine-core process, aborts, validation, engine death."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from vllm import LLM, SamplingParams, StructuredOutputsParams
from vllm.outputs import OutputKind
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.async_llm import AsyncLLM, EngineDeadError

MODEL = "demo-tiny"
MAX_MODEL_LEN = 256
PROMPTS = ["Hello world", "The capital of France is", "1, 2, 3,"]


def _args(**kwargs) -> EngineArgs:
    return EngineArgs(model=MODEL, max_model_len=MAX_MODEL_LEN, **kwargs)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(loop):
    engine = AsyncLLM.from_engine_args(_args())
    yield engine
    engine.shutdown()
    loop.run_until_complete(asyncio.sleep(0.01))  # lets the cancelled listener finish


@pytest.fixture(scope="module")
def reference():
    """The in-process offline LLM: the oracle for what AsyncLLM must produce."""
    llm = LLM(MODEL, max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


async def _final(engine: AsyncLLM, prompt, params, rid: str,
                 kind: OutputKind = OutputKind.CUMULATIVE):
    outputs = [o async for o in engine.generate(prompt, params, rid, kind)]
    assert outputs and outputs[-1].finished
    assert all(not o.finished for o in outputs[:-1])
    return outputs


async def _wait_stats(engine: AsyncLLM, predicate, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine.last_stats is not None and predicate(engine.last_stats):
            return engine.last_stats
        await asyncio.sleep(0.02)
    raise AssertionError(f"stats never matched: {engine.last_stats}")


async def _settled_stats(engine: AsyncLLM):
    """The stats once the engine is idle and has sent nothing new for a while."""
    await _wait_stats(engine, lambda s: s.num_running == 0 and s.num_waiting == 0)
    while True:
        seen = engine.last_stats
        await asyncio.sleep(0.3)
        if engine.last_stats is seen:
            return seen


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=10),
    SamplingParams(temperature=1.0, seed=42, max_tokens=10, n=2),
    SamplingParams(temperature=1.0, seed=7, max_tokens=20, stop=["e", " t"]),
])
def test_matches_offline_llm(loop, engine, reference, params):
    expected = reference.generate(PROMPTS, params, use_tqdm=False)

    async def run():
        finals = []
        for i, prompt in enumerate(PROMPTS):
            finals.append((await _final(engine, prompt, params, f"m{id(params)}-{i}"))[-1])
        return finals

    finals = loop.run_until_complete(run())
    for got, want in zip(finals, expected):
        assert [c.text for c in got.outputs] == [c.text for c in want.outputs]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert [c.finish_reason for c in got.outputs] == [c.finish_reason for c in want.outputs]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=3, max_tokens=24, n=3),
    SamplingParams(temperature=1.0, seed=5, max_tokens=24, stop=["a", "in"], logprobs=2),
])
def test_delta_and_final_only_outputs_agree_with_cumulative(loop, engine, params):
    async def run():
        cumulative = (await _final(engine, PROMPTS[1], params, "cum"))[-1]
        deltas = await _final(engine, PROMPTS[1], params, "delta", OutputKind.DELTA)
        final = await _final(engine, PROMPTS[1], params, "final", OutputKind.FINAL_ONLY)
        return cumulative, deltas, final

    cumulative, deltas, final = loop.run_until_complete(run())
    # A final-only request gets one output, the cumulative one's last.
    assert len(final) == 1 and final[0].outputs == cumulative.outputs
    for want in cumulative.outputs:
        parts = [c for d in deltas for c in d.outputs if c.index == want.index]
        assert "".join(c.text for c in parts) == want.text
        assert [t for c in parts for t in c.token_ids] == want.token_ids
        assert [c.finish_reason for c in parts if c.finish_reason] == [want.finish_reason]
        if want.logprobs is not None:
            assert [lp for c in parts for lp in c.logprobs] == want.logprobs


def test_cancelled_consumer_aborts_in_engine(loop, engine):
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def run():
        before = (await _settled_stats(engine)).num_aborted_requests
        got_first = asyncio.Event()

        async def consume():
            async for _ in engine.generate("abort me", params, "cancel-me", OutputKind.DELTA):
                got_first.set()

        task = asyncio.create_task(consume())
        await got_first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.num_unfinished_requests == 0
        stats = await _wait_stats(engine, lambda s: s.num_aborted_requests == before + 1
                                  and s.num_running == 0 and s.num_waiting == 0)
        assert stats.kv.num_free_blocks == stats.kv.num_blocks

        # Leaving the loop early (the generator is closed) aborts as well.
        gen = engine.generate("break me", params, "break-me")
        async for _ in gen:
            break
        await gen.aclose()
        stats = await _wait_stats(engine, lambda s: s.num_aborted_requests == before + 2
                                  and s.num_running == 0)
        assert stats.kv.usage == 0.0
        assert engine.num_unfinished_requests == 0

    loop.run_until_complete(run())


def test_bad_input_raises_before_admission(loop, engine):
    async def run():
        with pytest.raises(ValueError, match="max_tokens"):
            await engine.add_request("too-long", "x", SamplingParams(max_tokens=MAX_MODEL_LEN))
        with pytest.raises(ValueError, match="prompt"):
            await engine.add_request("long-prompt", list(range(MAX_MODEL_LEN)),
                                     SamplingParams(max_tokens=1))
        with pytest.raises(ValueError, match="structured_outputs.regex"):
            await engine.add_request(
                "bad-regex", "x",
                SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")),
            )
        stream = await engine.add_request("dup", "x", SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="request_id"):
            await engine.add_request("dup", "x", SamplingParams(max_tokens=2))
        outs = [o async for o in stream]
        assert outs[-1].finished
        assert engine.num_unfinished_requests == 0

    loop.run_until_complete(run())


def test_structured_output_request(loop, engine):
    params = SamplingParams(max_tokens=10, n=2, seed=1,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))

    async def run():
        return (await _final(engine, "Answer:", params, "so"))[-1]

    final = loop.run_until_complete(run())
    assert all(c.text in ("yes", "no") and c.finish_reason == "stop" for c in final.outputs)


@pytest.mark.timeout(120)
def test_engine_death_fails_requests():
    loop = asyncio.new_event_loop()
    engine = AsyncLLM.from_engine_args(_args())
    try:
        async def run():
            engine.start()
            assert engine.is_healthy
            stream = await engine.add_request("victim", "x",
                                              SamplingParams(max_tokens=200, ignore_eos=True),
                                              OutputKind.DELTA)
            await stream.__anext__()
            os.kill(engine.engine_core.pid, signal.SIGKILL)
            # A hang here fails the test at its timeout marker.
            with pytest.raises(EngineDeadError, match="SIGKILL"):
                async for _ in stream:
                    pass
            assert engine.errored and not engine.is_healthy
            assert engine.num_unfinished_requests == 0
            with pytest.raises(EngineDeadError):
                await engine.add_request("after", "x", SamplingParams(max_tokens=1))

        loop.run_until_complete(run())
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0.01))
        loop.close()
