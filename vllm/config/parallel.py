"""How the model is split across ranks and how the ranks run (`ParallelConfig`)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vllm.options import check_executor_name

if TYPE_CHECKING:
    from vllm.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class ParallelConfig:
    """How the model is split across ranks, and how the ranks run.

    `world_size` is always `tensor_parallel_size * pipeline_parallel_size` (derived, never
    passed). The executor defaults to `mp` (one process per rank) when the world size is above
    1, else to `uni` (one worker in the engine process); `ray` runs one Ray actor per rank,
    on this machine or across a Ray cluster.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # A name from EXECUTORS in vllm/options.py ("uni", "mp", "ray") or an Executor subclass;
    # None picks mp for more than one rank, else uni.
    distributed_executor_backend: str | type | None = None
    # Ray only: "pack" puts the ranks on as few nodes as possible, "spread" on as many.
    ray_placement: str = "pack"
    # Engine cores behind one API server, each with world_size ranks of its own.
    data_parallel_size: int = 1
    # Seconds an engine core with nothing to run waits between checks that its workers live
    # (a dead worker is otherwise found only by the next request).
    health_check_interval_s: float = 2.0
    world_size: int = field(init=False)

    def __post_init__(self) -> None:
        for flag, value in (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
            ("--data-parallel-size", self.data_parallel_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag}: must be a positive integer, got {value!r}")
        interval = self.health_check_interval_s
        if (isinstance(interval, bool) or not isinstance(interval, (int, float))
                or not math.isfinite(interval) or interval <= 0):
            raise ValueError(
                f"--health-check-interval: must be a positive number of seconds, got {interval!r}"
            )
        self.world_size = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "mp" if self.world_size > 1 else "uni"
        limit, _ = self.executor_facts()  # an unknown name or class fails here
        if self.ray_placement not in ("pack", "spread"):
            raise ValueError(
                f"--ray-placement: must be 'pack' or 'spread', got {self.ray_placement!r}"
            )
        if limit is not None and self.world_size > limit:
            runs = "a single worker in the engine process" if limit == 1 else f"{limit} ranks"
            raise ValueError(
                f"--distributed-executor-backend {self.backend_name()}: runs {runs}, but "
                f"{self.describe()} needs {self.world_size} ranks; use mp (the default when the "
                "world size is above 1)"
            )

    def executor_facts(self) -> tuple[int | None, bool]:
        """(max_world_size, remote_devices) of the executor `distributed_executor_backend`
        names (from vllm/options.py, nothing imported) or is.

        Raises ValueError naming the flag for an unknown name or an object that is not an
        executor class (a class without `dispatch`; engine start checks it subclasses
        Executor).
        """
        backend = self.distributed_executor_backend
        if isinstance(backend, str):
            entry = check_executor_name(backend)
            return entry.max_world_size, entry.remote_devices
        if not isinstance(backend, type) or not callable(getattr(backend, "dispatch", None)):
            name = getattr(backend, "__qualname__", type(backend).__qualname__)
            raise ValueError(
                f"--distributed-executor-backend: a class must subclass Executor, got {name}")
        return backend.max_world_size, backend.remote_devices

    def backend_name(self) -> str:
        """`distributed_executor_backend` as a flag value: its name, or a given class's name."""
        backend = self.distributed_executor_backend
        return backend if isinstance(backend, str) else backend.__qualname__

    def describe(self) -> str:
        """The layout in flag terms, for error messages."""
        return (
            f"--tensor-parallel-size {self.tensor_parallel_size} x "
            f"--pipeline-parallel-size {self.pipeline_parallel_size}"
        )

    def verify_with_model_config(self, model_config: ModelConfig) -> None:
        """Checks that the model splits into this layout. Raises ValueError naming the flag.

        Tensor parallelism splits the attention heads evenly across the ranks; the KV heads
        are either split evenly too, or (when there are fewer of them than ranks) each is
        replicated on the same number of ranks, and so must the MLP width. Pipeline
        parallelism gives every stage at least one layer.
        """
        hf = model_config.hf_config
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        num_heads = getattr(hf, "num_attention_heads", None)
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
        num_layers = getattr(hf, "num_hidden_layers", None)
        if num_heads is not None and num_heads % tp:
            raise ValueError(
                f"--tensor-parallel-size {tp}: the model's {num_heads} attention heads do not "
                f"divide evenly among {tp} ranks"
            )
        if num_kv_heads is not None and num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(
                f"--tensor-parallel-size {tp}: the model's {num_kv_heads} KV heads can neither "
                f"be split evenly among {tp} ranks nor replicated evenly ({tp} is not a "
                f"multiple of {num_kv_heads})"
            )
        intermediate = getattr(hf, "intermediate_size", None)
        if intermediate is not None and intermediate % tp:
            raise ValueError(
                f"--tensor-parallel-size {tp}: the model's MLP width ({intermediate}) does not "
                f"divide evenly among {tp} ranks"
            )
        if num_layers is not None and pp > num_layers:
            raise ValueError(
                f"--pipeline-parallel-size {pp}: more stages than the model's {num_layers} "
                "layers (every stage needs at least one)"
            )

    def verify_devices(self, device: torch.device) -> None:
        """Checks that this machine can host the ranks on `device`.

        On CUDA every rank needs a GPU of its own (ValueError otherwise). On CPU the ranks
        share the cores: more ranks than cores is allowed, with a warning, and each rank still
        gets at least one thread.
        """
        ranks = self.world_size * self.data_parallel_size
        if ranks == 1 or self.executor_facts()[1]:
            return  # the executor places the ranks on a cluster's devices, not this machine's
        if device.type == "cuda":
            count = torch.cuda.device_count()
            if ranks > count:
                what = self.describe() + (
                    f" x --data-parallel-size {self.data_parallel_size}"
                    if self.data_parallel_size > 1 else "")
                raise ValueError(
                    f"{what} = {ranks} ranks need {ranks} GPUs (one per rank), but {count} "
                    f"{'is' if count == 1 else 'are'} visible"
                )
            return
        from vllm import thread_policy

        cpus = thread_policy.available_cpus()
        if ranks > cpus:
            threads = thread_policy.derive(ranks, cpus=cpus).num_threads
            logger.warning(
                "%s = %d ranks on %d CPU core(s): more ranks than cores, so the ranks share "
                "them; each rank gets %d thread(s) and the forward passes will be slower",
                self.describe(), ranks, cpus, threads,
            )
