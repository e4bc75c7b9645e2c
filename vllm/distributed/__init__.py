"""Parallel layouts and process groups (parallel_state.py), and the process cleanup
upstream's tests import from here."""

from __future__ import annotations

from vllm.distributed.cleanup import cleanup_dist_env_and_memory

__all__ = ["cleanup_dist_env_and_memory"]
