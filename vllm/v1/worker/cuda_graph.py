"""CUDA graphs for decode-only batches.

A decode batch of n requests (one new token each) is padded to the next captured size B and
replayed from a graph captured over the persistent input buffers: padded requests have no query
tokens and padded tokens write no KV (slot -1). Larger or mixed batches run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from vllm.attention.backends.abstract import AttentionMetadata
from vllm.v1.worker.input_buffers import InputBuffers

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
                    logger.warning(
                        "CUDA graph capture for batch %d failed; smaller batches pad up to a "
                        "captured size or run eagerly: %s", size, e,
                    )
                    torch.cuda.synchronize()
                    break
        torch.cuda.current_stream().wait_stream(stream)

    def replay(self, size: int) -> torch.Tensor:
        """Replays the graph of `size`; returns its output buffer ([size, hidden])."""
        self.graphs[size].replay()
        return self.outputs[size]


def capture_decode_graphs(
    model: torch.nn.Module,
    buffers: InputBuffers,
    kv_caches: list[torch.Tensor],
    max_num_reqs: int,
    max_len: int,
) -> DecodeGraphs | None:
    """Captures `model`'s decode forward over the persistent input buffers for every size of
    the ladder (CUDA only); None when no size could be captured. Side effect: the buffers
    hold dummy inputs afterwards."""
    graphs = DecodeGraphs(capture_sizes(max_num_reqs))
    max_blocks = buffers.device_buffers["block_table"].shape[1]

    def prepare(size: int) -> None:
        buffers.stage(
            {
                "input_ids": np.zeros(size, dtype=np.int64),
                "positions": np.zeros(size, dtype=np.int64),
                "slot_mapping": np.full(size, -1, dtype=np.int64),
                "query_start_loc": np.arange(size + 1, dtype=np.int32),
                "seq_lens": np.ones(size, dtype=np.int32),
                "block_table": np.zeros((size, max_blocks), dtype=np.int32),
            }
        )

    def run(size: int) -> torch.Tensor:
        buf = buffers.device_buffers
        metadata = AttentionMetadata(
            num_actual_tokens=size,
            num_reqs=size,
            max_query_len=1,
            max_seq_len=max_len,
            query_start_loc=buf["query_start_loc"][: size + 1],
            seq_lens=buf["seq_lens"][:size],
            block_table=buf["block_table"][:size],
            slot_mapping=buf["slot_mapping"][:size],
            query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.full((size,), max_len, dtype=torch.int32),
        )
        return model(buf["input_ids"][:size], buf["positions"][:size], kv_caches, metadata)

    with torch.inference_mode():
        graphs.capture(prepare, run)
    logger.info("captured CUDA graphs for decode batch sizes %s", sorted(graphs.graphs))
    return graphs if graphs.graphs else None
