"""DataParallelClient's pure parts: the routing order (merged stats: tests/v1/metrics/test_engine_stats.py (the client itself is
tested against `vllm serve -dp 2` in tests/entrypoints/openai/test_data_parallel.py)."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.config import ParallelConfig
from vllm.v1.engine.data_parallel import EngineState
from vllm.v1.metrics.engine_stats import EngineCoreStats, KVCacheStats


def _stats(running: int, usage: float, blocks: int) -> EngineCoreStats:
    return EngineCoreStats(
        num_running=running, num_waiting=1, num_preemptions=2, num_aborted_requests=1,
        timestamp=float(running), kv=KVCacheStats(usage=usage, num_blocks=blocks))


def test_routing_prefers_fewer_unfinished_then_less_cache_then_fewer_routed() -> None:
    busy = EngineState(0, num_routed=1, unfinished={"a"})
    idle_full = EngineState(1, num_routed=0, stats=_stats(0, 0.9, 10))
    idle_empty = EngineState(2, num_routed=5, stats=_stats(0, 0.1, 10))
    fresh = EngineState(3, num_routed=6, stats=_stats(0, 0.1, 10))
    assert min([busy, idle_full, idle_empty, fresh], key=EngineState.load) is idle_empty
    assert min([busy, idle_full], key=EngineState.load) is idle_full


def test_data_parallel_size_is_validated() -> None:
    with pytest.raises(ValueError, match=r"--data-parallel-size: must be a positive integer"):
        ParallelConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match=r"--data-parallel-size 2: the offline engine runs one"):
        LLM("demo-tiny", data_parallel_size=2)


class _FakeClient:
    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.dead_reason = None

    def add_request(self, request) -> None:
        self.added.append(request.request_id)

    def abort_requests(self, ids: list[str]) -> None:
        self.aborted += ids


def _client(num_engines: int):
    from vllm.v1.engine.data_parallel import DataParallelClient

    client = DataParallelClient.__new__(DataParallelClient)
    client.engines = [EngineState(i) for i in range(num_engines)]
    client.clients = [_FakeClient() for _ in range(num_engines)]
    client.retried = set()
    return client


def req(request_id: str):
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(request_id, [1, 2], SamplingParams(), 0.0)


def test_samples_of_one_request_go_to_one_engine_and_aborts_follow_them() -> None:
    client = _client(2)
    client.add_requests([req("a-0"), req("a-1"), req("a-2")])
    client.add_requests([req("b-0")])
    client.add_requests([req("c-0")])
    assert [c.added for c in client.clients] == [["a-0", "a-1", "a-2"], ["b-0", "c-0"]]
    client.abort_requests(["c-0", "a-1", "unknown"])
    assert [c.aborted for c in client.clients] == [["a-1"], ["c-0"]]
    assert [len(s.unfinished) for s in client.engines] == [2, 1]


def test_a_request_a_dead_engine_never_answered_is_retried_once_on_a_live_one() -> None:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    client = _client(3)
    seen: list[EngineCoreOutputs] = []
    client._on_outputs, client._on_stats, client._on_dead = seen.append, None, None
    client.add_requests([req("quiet"), req("answered")])  # both on engine 0
    client._outputs(0, EngineCoreOutputs([EngineCoreOutput("answered", [7])]))
    client._engine_died(0, "killed")
    # The answered request fails (its client saw tokens); the quiet one moves on, unharmed.
    errors = [o.request_id for outs in seen for o in outs.outputs if o.finish_reason == "error"]
    assert errors == ["answered"]
    moved_to = next(s.index for s in client.engines if "quiet" in s.unfinished)
    assert moved_to != 0 and client.clients[moved_to].added == ["quiet"]
    # Once only: when that engine dies too, the request fails although engine 3 serves.
    client._engine_died(moved_to, "killed again")
    errors = [o.request_id for outs in seen for o in outs.outputs if o.finish_reason == "error"]
    assert errors == ["answered", "quiet"]
