"""A worker owns one device (or, on CPU, its share of the cores) and its model runner."""

from __future__ import annotations

import torch

from vllm.config import VllmConfig
from vllm.distributed.parallel_state import (
    ParallelContext,
    ParallelLayout,
    destroy_distributed,
    init_distributed,
)
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

_GiB = 1 << 30
# CPU default for the KV cache when --kv-cache-memory is not given.
_DEFAULT_CPU_KV_BYTES = 2 * _GiB


def kv_cache_blocks(
    block_bytes: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    *,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    free: int | None,
    total: int | None,
    reserved: int = 0,
) -> int:
    """The number of KV blocks to allocate (possibly under one sequence; the caller checks).

    `free`/`total` are the device's memory in bytes (None on CPU). --kv-cache-memory, when
    given, is the cache's size on every device. Otherwise the cache never grows past what
    max_num_seqs sequences of max_model_len tokens can fill: on a GPU it takes the smaller of
    that and the memory left under --gpu-memory-utilization (less a headroom for activations
    and the sampler's vocabulary-sized temporaries, and `reserved` bytes the runner allocates
    after the cache); on CPU the smaller of that and 2 GiB.
    """
    # Each sequence fills whole blocks: a partly used last block is still a block.
    wanted = max_num_seqs * -(-max_model_len // block_size) * block_bytes
    if kv_cache_memory is not None:
        budget = kv_cache_memory
    elif total is None or free is None:
        budget = min(_DEFAULT_CPU_KV_BYTES, wanted)
    else:
        # What others hold (weights, other engines, other processes) counts against the
        # fraction: two engines that each take all they are allowed would not both start.
        budget = min(wanted, int(total * gpu_memory_utilization) - (total - free) - _GiB
                     - reserved)
    return max(int(budget // block_bytes), 0)


class Worker:
    """Loads the model, sizes and allocates the KV cache, and runs steps."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        rank: int = 0,
        distributed_init_method: str | None = None,
    ) -> None:
        """Joins the world of `rank` when the layout has more than one rank (every rank of
        the world must be constructed at the same time, with the same init method)."""
        self.config = vllm_config
        pc = vllm_config.parallel_config
        layout = ParallelLayout(pc.tensor_parallel_size, pc.pipeline_parallel_size, rank)
        self.parallel = ParallelContext.single()
        if layout.world_size > 1:
            if distributed_init_method is None:
                raise ValueError(
                    f"{pc.describe()}: a worker of a multi-rank world needs an init method"
                )
            device = vllm_config.model_config.device
            if device.type == "cuda":
                # One GPU per rank; "cuda" then means this rank's device everywhere.
                torch.cuda.set_device(rank % torch.cuda.device_count())
            self.parallel = init_distributed(layout, distributed_init_method, device)
        self.model_runner = GPUModelRunner(vllm_config, self.parallel)

    def load_model(self) -> None:
        """Loads the model weights onto the device."""
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit in the memory the configuration allows.

        Raises ValueError when the cache cannot hold one max_model_len sequence.
        """
        cache = self.config.cache_config
        block_bytes = self.model_runner.kv_cache_block_bytes()
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
        else:
            free = total = None
            if self.model_runner.device.type == "cuda":
                # Blocks an engine closed earlier in this process left in the caching
                # allocator are free for this one.
                torch.cuda.empty_cache()
                free, total = torch.cuda.mem_get_info()
            sched = self.config.scheduler_config
            num_blocks = kv_cache_blocks(
                block_bytes, cache.block_size, sched.max_num_seqs, sched.max_model_len,
                kv_cache_memory=cache.kv_cache_memory,
                gpu_memory_utilization=cache.gpu_memory_utilization, free=free, total=total,
                reserved=self.model_runner.reserved_bytes(),
            )
        max_len = self.config.model_config.max_model_len
        if num_blocks * cache.block_size < max_len:
            raise ValueError(
                f"--kv-cache-memory/--gpu-memory-utilization: the KV cache holds "
                f"{max(num_blocks, 0) * cache.block_size} tokens, fewer than --max-model-len "
                f"({max_len}); give the cache more memory or lower --max-model-len"
            )
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocates num_blocks KV blocks on the device."""
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Runs the forward pass of one step."""
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Samples the oldest executed-but-unsampled step."""
        return self.model_runner.sample_tokens(grammar_output)

    def close(self) -> None:
        """Leaves the distributed world, if it joined one. Idempotent."""
        if self.parallel.layout.world_size > 1:
            destroy_distributed(self.parallel)
