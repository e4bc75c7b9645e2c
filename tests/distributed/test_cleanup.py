"""`vllm.distributed.cleanup_dist_env_and_memory`, as upstream's tests call it."""

from __future__ import annotations

import gc
import weakref

import torch.distributed as dist

from vllm.distributed import cleanup_dist_env_and_memory


class _Node:
    def __init__(self) -> None:
        self.self_ref = self  # a cycle: only the garbage collector frees it


def test_cleanup_destroys_the_process_group_and_collects_cycles(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}",
                            rank=0, world_size=1)
    gc.disable()  # so only the cleanup can collect the cycle below
    try:
        node = _Node()
        alive = weakref.ref(node)
        del node
        assert alive() is not None
        cleanup_dist_env_and_memory()
        assert alive() is None
    finally:
        gc.enable()
    assert not dist.is_initialized()
    # Nothing left to free: a second call (and one asking for Ray) is a no-op.
    cleanup_dist_env_and_memory(shutdown_ray=True)
