"""`cleanup_dist_env_and_memory`: what a test or script calls between engines in one process
(upstream's name, imported from `vllm.distributed` by upstream's tests)."""

from __future__ import annotations

import gc
import sys


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Frees what this process still holds after its engines were shut down.

    Destroys this process's torch.distributed process group, if it created one; shuts Ray
    down when `shutdown_ray` is true and Ray was started here; runs the garbage collector;
    and returns the CUDA caching allocator's free blocks to the driver when CUDA was used.
    Safe on a CPU-only machine and when nothing is left (each step is then a no-op).
    The engines of this package run their workers in processes of their own, which their
    shutdown already ended; this frees only what the calling process holds.
    """
    # Imported only if this process already loaded them: cleaning up must not start them.
    torch = sys.modules.get("torch")
    if torch is not None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if shutdown_ray:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
    gc.collect()
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
