"""CUDA graphs for decode-only batches.

A decode batch of n requests (one new token each) is padded to the next captured size B and
replayed from a graph captured over the persistent input buffers: padded requests have no query
tokens and padded tokens write no KV (slot -1). Larger or mixed batches run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch-size ladder: 1, 2, 4, 8, then multiples of 16 up to max_num_seqs (and it)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(sizes)


class DecodeGraphs:
    """Captured forward passes keyed by padded batch size."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest captured size holding num_reqs, or None to run eagerly."""
        for size in self.sizes:
            if size >= num_reqs and size in self.graphs:
                return size
        return None

    def capture(
        self, prepare: Callable[[int], None], run: Callable[[int], torch.Tensor]
    ) -> None:
        """Captures run(B) -> hidden states for every size, largest first (so smaller graphs
        share its memory pool). prepare(B) stages dummy inputs outside the graph first (host
        copies must not be captured). On a failure logs a warning and captures nothing smaller."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in sorted(self.sizes, reverse=True):
                try:
                    prepare(size)
                    torch.cuda.synchronize()
                    for _ in range(2):  # warm up kernels (Triton autotuning, allocator)
                        run(size)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        out = run(size)
                    self.pool = graph.pool()
                    self.graphs[size] = graph
                    self.outputs[size] = out
                except Exception as e:  # noqa: BLE001 - any capture failure means eager
                    # A failed capture can leave the stream unusable for further captures:
                    # stop here; sizes without a graph run eagerly.
                    logger.warning("CUDA graph capture for batch %d failed; smaller batches pad up to a "
                                   "captured size or run eagerly: %s", size, e)
                    torch.cuda.synchronize()
                    break
        torch.cuda.current_stream().wait_stream(stream)

    def replay(self, size: int) -> torch.Tensor:
        """Replays the graph of `size`; returns its output buffer ([size, hidden])."""
        self.graphs[size].replay()
        return self.outputs[size]
