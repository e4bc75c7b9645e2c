"""Workers as Ray actors, on one machine or across a cluster (`--distributed-executor-backend
ray`; docs/architecture.md §10).

One actor per rank, placed by one placement group with a bundle per rank. The engine process
joins a running cluster (`ray.init(address="auto")`: RAY_ADDRESS, or a cluster started with
`ray start` on this machine) or, when there is none, starts a local one that it stops again
at shutdown. torch.distributed meets over TCP at rank 0's node address.

Calls reach the actors in the order they are made (Ray runs one caller's tasks on an actor
in submission order), so `execute_model` and `sample_tokens` keep the same contract as on
the mp executor: non-blocking futures resolved in call order, answered by the output rank.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import secrets
import shutil
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm import thread_policy
from vllm.config import VllmConfig
from vllm.distributed.parallel_state import ParallelLayout
from vllm.utils.temp_dirs import socket_dir
from vllm.v1.executor import worker_messages
from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.ray_worker import RayWorker, as_bytes
from vllm.v1.executor.worker_messages import Call, Failure, MessageDecodeError, Result
from vllm.v1.executor.worker_messages import WorkerMethod

logger = logging.getLogger(__name__)

# Seconds to wait for the cluster to grant the placement group, and for every rank to load.
_PLACEMENT_TIMEOUT_S = 60.0
_STARTUP_TIMEOUT_S = 600.0
# Seconds the actors get to leave the distributed world at shutdown before they are killed.
_CLOSE_TIMEOUT_S = 5.0
# Seconds a call that a worker failed waits for news that another rank died (see _Gather).
_PEER_DEATH_GRACE_S = 3.0
# --ray-placement values and the placement group strategy each one uses.
PLACEMENTS = {"pack": "PACK", "spread": "SPREAD"}
# The actors' concurrency group of RayWorker.watch, beside the default one that runs calls.
_WATCH_GROUP = "watch"


class _DeathPipe:
    """A pipe whose read end turns readable once a rank has died (the executor's death
    sentinel): written from Ray's callback threads, closed at release."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()
        self._closed = False

    def fire(self) -> None:
        """Makes the read end readable (once is enough: nobody reads it)."""
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._write_fd, b"!")
            except BlockingIOError:  # full: already readable
                pass

    def close(self) -> None:
        """Closes both ends. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self.read_fd)
                os.close(self._write_fd)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "--distributed-executor-backend ray needs the `ray` package: "
            "pip install -e '.[ray]'"
        ) from exc
    return ray


# Ray's token authentication reads these; a local cluster of ours sets its own for its life.
_RAY_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@dataclass
class _LocalCluster:
    """A Ray cluster this process started for itself, and how to leave no trace of it.

    Its session files live in a private directory (removed at stop), and unless the user
    configured Ray's token authentication, it uses a token of its own passed in the
    environment: Ray would otherwise write one to ~/.ray/auth_token, and from then on the
    user's own `ray start` clusters would expect it.
    """

    temp_dir: str
    # The auth variables as they were before start (None: unset), restored at stop.
    saved_env: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def start(cls, ray: Any, num_cpus: int) -> _LocalCluster:
        """Starts the cluster (ray.init); raises what ray.init raises, leaving nothing."""
        cluster = cls(socket_dir("vllm-ray-", max_len=40))
        if not any(os.environ.get(name) for name in _RAY_AUTH_VARS):
            cluster.saved_env = {name: os.environ.get(name) for name in _RAY_AUTH_VARS}
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        try:
            ray.init(num_cpus=num_cpus, log_to_driver=False, include_dashboard=False,
                     _temp_dir=cluster.temp_dir)
        except BaseException:
            cluster.stop(ray)
            raise
        return cluster

    def stop(self, ray: Any) -> None:
        """Stops the cluster, restores the environment and removes the session files."""
        if ray.is_initialized():
            ray.shutdown()
        for name, value in self.saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _connect(ray: Any, num_ranks: int) -> _LocalCluster | None:
    """Joins a running cluster, or starts a local one. Returns the local cluster this process
    started (and so must stop), or None."""
    if ray.is_initialized():
        return None
    try:
        ray.init(address="auto", log_to_driver=False)
        logger.info("RayExecutor: joined the running Ray cluster")
        return None
    except ConnectionError as exc:
        if os.environ.get("RAY_ADDRESS"):
            # The user named a cluster: starting another one would hide the mistake.
            raise RuntimeError(
                f"RayExecutor: cannot join the Ray cluster at RAY_ADDRESS="
                f"{os.environ['RAY_ADDRESS']}: {exc}"
            ) from exc
    # Every rank's bundle asks for one CPU; on a machine with fewer cores the ranks share
    # them, as they do on the mp executor.
    cluster = _LocalCluster.start(ray, max(thread_policy.available_cpus(), num_ranks))
    logger.info("RayExecutor: no running Ray cluster found; started a local one")
    return cluster


def _bundle(device_type: str) -> dict[str, float]:
    return {"GPU": 1.0, "CPU": 1.0} if device_type == "cuda" else {"CPU": 1.0}


class _Gather:
    """The replies of every rank to one call, as one Future: every rank's result by rank
    (`output_rank` None) or the output rank's.

    A rank that died fails the Future at once. An error a worker raised fails it once every
    rank has answered, or after _PEER_DEATH_GRACE_S: when a rank dies, its peers' collectives
    break and usually report before the death is known, and the death is the cause to name.
    """

    def __init__(
        self,
        num_ranks: int,
        output_rank: int | None,
        is_death: Callable[[BaseException], bool],
        explain: Callable[[BaseException, int], BaseException],
    ) -> None:
        self.future: Future = Future()
        self._num_ranks = num_ranks
        self._output_rank = output_rank
        self._is_death = is_death
        self._explain = explain
        self._results: dict[int, Any] = {}
        self._errors: dict[int, BaseException] = {}
        self._lock = threading.Lock()

    def on_done(self, rank: int, done: Future) -> None:
        """Takes one rank's reply (a done Ray future)."""
        exc = done.exception()
        with self._lock:
            if self.future.done():
                return
            if exc is None:
                self._results[rank] = done.result()
            elif self._is_death(exc):
                self.future.set_exception(self._explain(exc, rank))
                return
            else:
                if not self._errors:
                    timer = threading.Timer(_PEER_DEATH_GRACE_S, self._fail_with_first_error)
                    timer.daemon = True
                    timer.start()
                self._errors[rank] = exc
            if len(self._results) + len(self._errors) < self._num_ranks:
                return
            if self._errors:
                self._fail_with_first_error_locked()
            elif self._output_rank is None:
                self.future.set_result([self._results[r] for r in range(self._num_ranks)])
            else:
                self.future.set_result(self._results[self._output_rank])

    def missing(self) -> list[int]:
        """The ranks that have not answered yet."""
        with self._lock:
            answered = self._results.keys() | self._errors.keys()
        return [rank for rank in range(self._num_ranks) if rank not in answered]

    def _fail_with_first_error(self) -> None:
        with self._lock:
            self._fail_with_first_error_locked()

    def _fail_with_first_error_locked(self) -> None:
        if not self.future.done():
            rank = min(self._errors)
            self.future.set_exception(self._explain(self._errors[rank], rank))


@dataclass
class _Cluster:
    """What this executor holds in the cluster, released by `release` (also from the
    finalizer: nothing here refers back to the executor)."""

    ray: Any
    # The local cluster this process started (stopped at release), or None.
    local: _LocalCluster | None
    placement_group: Any = None
    actors: list[Any] = field(default_factory=list)
    death_pipe: _DeathPipe | None = None
    released: bool = False

    def release(self) -> None:
        """Closes the workers (killing those that do not answer), removes the placement group,
        and stops the cluster if this process started it. Idempotent."""
        if self.released:
            return
        self.released = True
        ray = self.ray
        if self.actors:
            closing = [actor.close.remote() for actor in self.actors]
            ray.wait(closing, num_returns=len(closing), timeout=_CLOSE_TIMEOUT_S)
            for actor in self.actors:
                try:
                    ray.kill(actor)
                except Exception:  # already dead, or its node is gone
                    pass
        if self.placement_group is not None:
            try:
                ray.util.remove_placement_group(self.placement_group)
            except Exception:  # its node is gone: the cluster drops it
                pass
        if self.local is not None:
            self.local.stop(ray)
        if self.death_pipe is not None:
            self.death_pipe.close()


class RayExecutor(Executor):
    """Runs `parallel_config.world_size` workers as Ray actors. Every call goes to all of them
    and is answered by the output rank (the first rank of the last pipeline stage); futures
    complete in call order. A dead actor or node fails pending and later calls with
    RuntimeError naming the rank and its node.

    Raises at construction ImportError without ray, RuntimeError when the cluster cannot
    place the ranks, and what a worker raised while loading its model.
    """

    remote_devices: ClassVar[bool] = True

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        ray = _import_ray()
        pc = vllm_config.parallel_config
        self.world_size = pc.world_size
        self.output_rank = ParallelLayout(
            pc.tensor_parallel_size, pc.pipeline_parallel_size
        ).output_rank
        self._ray = ray
        self._cluster = _Cluster(ray, _connect(ray, self.world_size))
        self._finalizer = weakref.finalize(self, self._cluster.release)
        self._finalizer.atexit = False
        atexit.register(self._finalizer)
        self._lock = threading.Lock()
        self._error: str | None = None
        # By rank: the Future of the last health-check ping (see check_health).
        self._pings: list[Future | None] = []
        self._call_ids = itertools.count()
        self.node_ips: list[str] = []
        self._node_ids: list[str] = []
        try:
            self._start(vllm_config, pc.ray_placement)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, vllm_config: VllmConfig, placement: str) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles = [_bundle(vllm_config.model_config.device.type)] * self.world_size
        group = placement_group(bundles, strategy=PLACEMENTS[placement])
        self._cluster.placement_group = group
        ready, _ = ray.wait([group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"RayExecutor: the Ray cluster cannot place {self.world_size} ranks of "
                f"{bundles[0]} each (--ray-placement {placement}) within "
                f"{_PLACEMENT_TIMEOUT_S:.0f} s; it has {ray.cluster_resources()}"
            )
        node_of = placement_group_table(group)["bundles_to_node_id"]
        ranks_on = {node: list(node_of.values()).count(node) for node in node_of.values()}
        nodes = ray.nodes()
        cpus_on = {n["NodeID"]: int(n["Resources"].get("CPU", 1)) for n in nodes}
        ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in nodes}
        self._node_ids = [node_of[rank] for rank in range(self.world_size)]
        self.node_ips = [ip_of[node] for node in self._node_ids]
        actor_class = ray.remote(concurrency_groups={_WATCH_GROUP: 1})(RayWorker)
        for rank in range(self.world_size):
            node = node_of[rank]
            local_rank = list(node_of.values())[:rank].count(node)
            # The ranks of a node share its cores (the mp executor's policy per node); a
            # value the user set in OMP_NUM_THREADS wins, as everywhere.
            policy = thread_policy.derive(ranks_on[node], cpus=cpus_on.get(node, 1))
            actor = actor_class.options(
                num_cpus=bundles[rank].get("CPU", 0),
                num_gpus=bundles[rank].get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": policy.env()},
            ).remote(rank, self.world_size, local_rank, self.output_rank)
            self._cluster.actors.append(actor)
        actors = self._cluster.actors
        ip, port = ray.get(actors[0].address.remote(), timeout=_STARTUP_TIMEOUT_S)
        init_method = f"tcp://{ip}:{port}"
        starts = [actor.start.remote(vllm_config, init_method) for actor in actors]
        gather = self._gather(starts, None, "at startup")
        try:
            gather.future.result(timeout=_STARTUP_TIMEOUT_S)
        except FutureTimeoutError:
            raise RuntimeError(f"RayExecutor: ranks {gather.missing()} did not start within "
                               f"{_STARTUP_TIMEOUT_S:.0f} s") from None
        self._watch(actors)

    def _watch(self, actors: list[Any]) -> None:
        """Keeps a `watch` call pending on every actor: Ray fails it when the actor dies,
        which records the death and fires the death pipe, whether or not a call runs."""
        pipe = self._cluster.death_pipe = _DeathPipe()
        this = weakref.ref(self)  # the callbacks must not keep the executor alive

        def on_end(rank: int, done: Future) -> None:
            executor = this()
            exc = done.exception()
            if executor is None or exc is None or executor._cluster.released:
                return
            if executor._is_death(exc):
                executor._explain(exc, rank, "between calls")
                pipe.fire()

        for rank, actor in enumerate(actors):
            ref = actor.watch.options(concurrency_group=_WATCH_GROUP).remote()
            ref.future().add_done_callback(lambda done, rank=rank: on_end(rank, done))

    def death_sentinels(self) -> list[int]:
        """The death pipe's read end (see _watch): readable once any rank has died."""
        pipe = self._cluster.death_pipe
        return [] if pipe is None else [pipe.read_fd]

    # ------------------------------------------------------------------ calls

    def _gather(self, refs: list[Any], output_rank: int | None, when: str) -> _Gather:
        """The replies to `refs` (one object ref per rank, by rank) as one `_Gather`, whose
        failures `_explain` words with `when`."""
        gather = _Gather(len(refs), output_rank, self._is_death,
                         lambda exc, rank: self._explain(exc, rank, when))
        for rank, ref in enumerate(refs):
            ref.future().add_done_callback(
                lambda done, rank=rank: gather.on_done(rank, self._unpack(done, rank, when)))
        return gather

    def _unpack(self, done: Future, rank: int, when: str) -> Future:
        """One rank's done Ray future as a Future of its reply's value: a Result's value, the
        rebuilt error of a Failure, None for a rank that did not reply; Ray's own errors (a
        dead actor) pass through."""
        if done.exception() is not None or done.result() is None:
            return done
        unpacked: Future = Future()
        where = f"worker rank {rank} (node {self.node_ips[rank]}) {when}"
        try:
            reply = worker_messages.decode(done.result())
        except MessageDecodeError as exc:
            # The value did not unpickle here: the call fails with that error.
            unpacked.set_exception(exc.error)
            return unpacked
        if isinstance(reply, Failure):
            unpacked.set_exception(reply.error.rebuild(where))
        else:
            unpacked.set_result(reply.value if isinstance(reply, Result) else reply)
        return unpacked

    def _is_death(self, exc: BaseException) -> bool:
        exceptions = self._ray.exceptions
        return isinstance(exc, (exceptions.RayActorError, exceptions.NodeDiedError,
                                exceptions.ObjectLostError))

    def _explain(self, exc: BaseException, rank: int, when: str) -> BaseException:
        """`exc` as the engine should see it: an actor or node that died becomes a
        RuntimeError naming the rank and node and marks the executor unusable; an error the
        worker raised passes through unchanged."""
        if not self._is_death(exc):
            return exc
        node = self.node_ips[rank] if rank < len(self.node_ips) else "?"
        message = (
            f"RayExecutor: worker rank {rank} (node {node}) died {when} "
            f"({type(exc).__name__}); the engine cannot continue"
        )
        with self._lock:
            if self._error is None:
                self._error = message
        return RuntimeError(message)

    def dispatch(self, method: WorkerMethod | Callable[..., Any], args: tuple,
                 reply_all: bool) -> Future:
        """Sends one Call to every rank (see Executor.dispatch); the Future fails as `_Gather`
        describes. A function must be importable on the cluster's nodes."""
        with self._lock:
            if self._error is not None:
                raise RuntimeError(self._error)
            if self._cluster.released:
                raise RuntimeError("RayExecutor: the executor has been shut down")
        # Encoded once, not once per rank by Ray: steps are sent to every rank.
        frames = as_bytes(worker_messages.encode(
            Call(next(self._call_ids), method, args, reply_all)))
        refs = [actor.call.remote(frames) for actor in self._cluster.actors]
        return self._gather(refs, None if reply_all else self.output_rank, "during a call").future

    def check_health(self) -> None:
        """Raises RuntimeError when a rank has died or a node of this executor is gone.

        Never waits on an actor: each call looks at the ping the previous call sent to every
        rank (a rank whose actor died answers it with RayActorError) and sends the next, so a
        rank that dies on a live node is reported by the second call after its death.
        """
        with self._lock:
            if self._error is not None:
                raise RuntimeError(self._error)
        alive = {n["NodeID"] for n in self._ray.nodes() if n["Alive"]}
        for rank, node in enumerate(self._node_ids):
            if node not in alive:
                message = (f"RayExecutor: the node of worker rank {rank} ({self.node_ips[rank]}) "
                           "is gone; the engine cannot continue")
                with self._lock:
                    self._error = self._error or message
                raise RuntimeError(message)
        actors = self._cluster.actors
        if len(self._pings) != len(actors):
            self._pings = [None] * len(actors)
        for rank, actor in enumerate(actors):
            ping = self._pings[rank]
            if ping is not None:
                if not ping.done():
                    # Queued behind calls still running: not an answer either way yet.
                    continue
                error = ping.exception()
                if error is not None:
                    raise self._explain(error, rank, "between calls")
            self._pings[rank] = actor.ping.remote().future()

    def shutdown(self) -> None:
        """Stops the actors and removes the placement group (and the local cluster this
        process started); pending calls fail. Idempotent."""
        self._finalizer()
        atexit.unregister(self._finalizer)
