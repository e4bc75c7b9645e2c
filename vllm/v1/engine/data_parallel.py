"""Data parallelism: several engine cores behind one front end (`--data-parallel-size N`).

`DataParallelClient` has the interface of `EngineCoreClient` and holds one per engine core.
Each engine core is a full engine (its own scheduler, KV cache, and tensor/pipeline-parallel
workers on any executor). A new request goes to the live engine with the fewest of this
front end's requests still unfinished, then the least KV cache in use; aborts go to the
engine that holds the request. Stats are summed into one snapshot. When one engine core
dies, the requests it never answered are sent once more, to a live engine (their clients
saw nothing, so nothing is lost); the rest of its requests fail (each ends with
finish_reason "error"). The others keep serving, and the client is dead only when every
engine is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from vllm.config import VllmConfig
from vllm.exceptions import EngineDeadError, ErrorKind
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from vllm.v1.engine.core_client import EngineCoreClient
from vllm.v1.metrics.engine_stats import EngineCoreStats

logger = logging.getLogger(__name__)


@dataclass
class EngineState:
    """What the front end knows about one engine core (also what /metrics and /health show)."""

    index: int
    # Requests sent to this engine since startup.
    num_routed: int = 0
    # Request ids sent to this engine and not finished or aborted yet.
    unfinished: set[str] = field(default_factory=set)
    # The requests of `unfinished` the engine has sent nothing for yet (they can move).
    unanswered: dict[str, EngineCoreRequest] = field(default_factory=dict)
    # The engine's latest stats snapshot.
    stats: EngineCoreStats | None = None
    # Why the engine core is gone; None while it serves.
    dead_reason: str | None = None

    @property
    def alive(self) -> bool:
        return self.dead_reason is None

    def load(self) -> tuple[int, float, int]:
        """Routing key: lower is less loaded."""
        usage = self.stats.kv.usage if self.stats is not None else 0.0
        return len(self.unfinished), usage, self.num_routed


class DataParallelClient:
    """N engine-core processes behind the EngineCoreClient interface (see module docstring).

    The constructor starts them all at once and blocks until every one is ready; if one
    fails, the others are stopped and its error is raised (as EngineCoreClient raises it).
    """

    def __init__(self, vllm_config: VllmConfig, startup_timeout_s: float | None = None) -> None:
        self.vllm_config = vllm_config
        size = vllm_config.parallel_config.data_parallel_size
        self.engines = [EngineState(i) for i in range(size)]
        # Requests already moved off a dead engine: a second death fails them.
        self.retried: set[str] = set()
        self._on_outputs: Callable[[EngineCoreOutputs], None] | None = None
        self._on_stats: Callable[[EngineCoreStats], None] | None = None
        self._on_dead: Callable[[str], None] | None = None
        with ThreadPoolExecutor(size, thread_name_prefix="vllm-dp-start") as pool:
            futures = [
                pool.submit(EngineCoreClient, vllm_config, startup_timeout_s, engine_index=i)
                for i in range(size)
            ]
        errors = [f.exception() for f in futures if f.exception() is not None]
        self.clients = [f.result() for f in futures if f.exception() is None]
        if errors:
            for client in self.clients:
                client.shutdown()
            raise errors[0]
        self.num_blocks = sum(client.num_blocks for client in self.clients)

    @property
    def pids(self) -> list[int | None]:
        """The engine-core process ids, by engine."""
        return [client.pid for client in self.clients]

    @property
    def dead_reason(self) -> str | None:
        """Why the engines are unusable (every one is gone), or None while one serves."""
        reasons = [s.dead_reason or c.dead_reason for s, c in zip(self.engines, self.clients)]
        if any(reason is None for reason in reasons):
            return None
        return "; ".join(f"engine {i}: {reason}" for i, reason in enumerate(reasons))

    def engine_states(self) -> list[EngineState]:
        """Every engine's routing counts, stats and health, by engine."""
        return self.engines

    def engine_of(self, request_id: str) -> int:
        """The index of the engine holding the unfinished request `request_id` (0 when no
        engine holds it)."""
        return next((s.index for s in self.engines if request_id in s.unfinished), 0)

    # ------------------------------------------------------------------ background tasks

    def start(
        self,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_stats: Callable[[EngineCoreStats], None],
        on_dead: Callable[[str], None],
    ) -> None:
        """Starts listening to every engine in the running event loop (idempotent).

        `on_dead` runs once, when the last engine is gone; an engine that dies before that
        ends its own requests through `on_outputs` with finish_reason "error".
        """
        if self._on_outputs is not None:
            return
        self._on_outputs, self._on_stats, self._on_dead = on_outputs, on_stats, on_dead
        for i, client in enumerate(self.clients):
            client.start(
                lambda outputs, i=i: self._outputs(i, outputs),
                lambda stats, i=i: self._stats(i, stats),
                lambda reason, i=i: self._engine_died(i, reason),
            )

    def _outputs(self, index: int, outputs: EngineCoreOutputs) -> None:
        state = self.engines[index]
        outputs.engine_index = index
        for out in outputs.outputs:
            state.unanswered.pop(out.request_id, None)
            if out.finished:
                state.unfinished.discard(out.request_id)
                self.retried.discard(out.request_id)
        assert self._on_outputs is not None
        self._on_outputs(outputs)

    def _stats(self, index: int, stats: EngineCoreStats) -> None:
        state = self.engines[index]
        if not state.alive:
            # A snapshot still queued when the engine died must not bring its gauges back.
            return
        state.stats = stats
        self._publish_stats()

    def _publish_stats(self) -> None:
        """Hands the sum of every engine's latest snapshot to the stats callback."""
        known = [s.stats for s in self.engines if s.stats is not None]
        if known and self._on_stats is not None:
            self._on_stats(EngineCoreStats.merge(known))

    def _engine_died(self, index: int, reason: str) -> None:
        state = self.engines[index]
        if state.dead_reason is not None:
            return
        state.dead_reason = reason
        if state.stats is not None:
            # Its counters stay in the sums; its gauges (running, waiting, KV cache) leave
            # them at once, not at the next live engine's snapshot.
            state.stats = state.stats.of_dead_engine()
            self._publish_stats()
        lost = sorted(state.unfinished)
        unanswered, state.unanswered = state.unanswered, {}
        state.unfinished.clear()
        if any(s.alive for s in self.engines):
            lost = [request_id for request_id in lost
                    if not self._retry(unanswered.get(request_id))]
            logger.error("data-parallel engine %d is gone (%s); %d of its requests fail, the "
                         "other engines keep serving", index, reason, len(lost))
            if lost and self._on_outputs is not None:
                message = f"data-parallel engine {index} is gone: {reason}"
                self._on_outputs(EngineCoreOutputs([
                    EngineCoreOutput(request_id, [], finish_reason="error", error=message,
                                     error_kind=ErrorKind.INTERNAL)
                    for request_id in lost
                ], engine_index=index))
        elif self._on_dead is not None:
            callback, self._on_dead = self._on_dead, None
            callback(self.dead_reason or reason)
        # Failed for good: a request id reused later may move again.
        self.retried.difference_update(lost)

    def _retry(self, request: EngineCoreRequest | None) -> bool:
        """Sends a request a dead engine never answered to a live engine, once per request;
        False when it cannot move (answered, moved before, or no live engine takes it)."""
        if request is None or request.request_id in self.retried:
            return False
        try:
            self.add_requests([request])
        except EngineDeadError:
            return False
        self.retried.add(request.request_id)
        logger.warning("request %s moved to another data-parallel engine", request.request_id)
        return True

    # ------------------------------------------------------------------ requests

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Sends the requests (the samples of one request) together to the least-loaded live
        engine, so they share its prefix cache. Raises EngineDeadError when every engine is
        gone (or the chosen one is, after some were sent: the caller aborts them all)."""
        live = [s for s in self.engines if s.alive and self.clients[s.index].dead_reason is None]
        if not live:
            raise EngineDeadError(self.dead_reason or "every data-parallel engine is gone")
        state = min(live, key=EngineState.load)
        for request in requests:
            self.clients[state.index].add_request(request)
            state.num_routed += 1
            state.unfinished.add(request.request_id)
            state.unanswered[request.request_id] = request

    def abort_requests(self, request_ids: list[str]) -> None:
        """Aborts each request in the engine that holds it (unknown ids are ignored)."""
        for state in self.engines:
            held = [request_id for request_id in request_ids if request_id in state.unfinished]
            if held:
                state.unfinished.difference_update(held)
                for request_id in held:
                    state.unanswered.pop(request_id, None)
                    self.retried.discard(request_id)
                self.clients[state.index].abort_requests(held)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stops every engine core. Idempotent."""
        self._on_dead = None
        for client in self.clients:
            client.shutdown(timeout_s)
