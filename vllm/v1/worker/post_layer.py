"""Everything after the layers of a decode step as one fixed sequence of operations.

For a decode step (one new token per request, every request sampling, no drafts) the work
after the layers is: the LM head over each request's last hidden state, the grammar
bitmask, the token edits (allowed_token_ids, one-token bad words, the min_tokens ban,
logit_bias), penalties, and sampling. Here that work reads only fixed device buffers (the
hidden rows, the sampling parameters and bitmask of SamplingBuffers, and each edited
request's slot of request_slots.py, whose token counts the function itself keeps current)
and writes a fixed output buffer, with the operations of ops/dense_sampling.py, so it never
waits for the device and a CUDA graph per (padded batch size, plan, masked or not, edited
or not) replays it. Every combination is captured at startup: a request that arrives,
leaves or changes mode only picks another graph.

What it does not do (logprobs, bad words of several tokens) sends the step back to the
eager path: its logits are computed from the same hidden rows and the Sampler samples them.
Both paths give the same tokens: the operations are the Sampler's own fixed-shape path, and
the noise keys are drawn from the same generator in the same order.

The runner uses this on CUDA with decode graphs (VLLM_SAMPLER_GRAPHS=0 turns it off); on a
CPU it runs eagerly, for the tests.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.sample.ops.dense_sampling import (
    Plan,
    apply_dense_bitmask,
    choose_plan,
    host_noise_keys,
    sample_dense,
)
from vllm.v1.sample.sampler import RACE_BLOCK, SamplerOutput
from vllm.v1.worker.cuda_graph import capture_sizes
from vllm.v1.worker.gpu_input_batch import CachedRequestState
from vllm.v1.worker.grammar_bitmask import reorder_bitmask
from vllm.v1.worker.input_buffers import host_to_device
from vllm.v1.worker.request_slots import History, RequestSlots
from vllm.v1.worker.sampling_buffers import SamplingBuffers

logger = logging.getLogger(__name__)

ENV = "VLLM_SAMPLER_GRAPHS"
# Logits elements per sampling chunk: the temporaries of a full sort and of the race stay
# about 44 bytes per element, whatever the batch.
CHUNK_ELEMENTS = 1 << 23


def sampler_graphs_enabled() -> bool:
    """Whether VLLM_SAMPLER_GRAPHS leaves the post-layer graphs on (anything but 0/false/no)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no")


def dense_ok(state: CachedRequestState) -> bool:
    """Whether a request's next token needs nothing the fixed sequence lacks (module
    docstring): no logprobs, no bad word of several tokens."""
    p = state.sampling_params
    return p.logprobs is None and not p.has_history_bans


class PostLayer:
    """The post-layer function over fixed buffers, and its graphs (see module docstring)."""

    def __init__(
        self,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        hidden_size: int,
        dtype: torch.dtype,
        vocab_size: int,
        max_rows: int,
        device: torch.device,
        generator: torch.Generator,
        min_rows: int = 1,
        history: History | None = None,
        to_device: Callable[[np.ndarray], torch.Tensor] | None = None,
    ) -> None:
        """`min_rows`: the fewest rows the LM head runs on (the runner's padding for batch
        invariance on a CPU); `generator` draws the unseeded rows' noise keys (CPU);
        `history`: the requests' tokens (SamplingInputs.penalty_history), from which
        penalty counts are rebuilt (None: penalized steps go eager); `to_device`: the
        host-to-device copy of small arrays (default: a pinned, non-blocking one)."""
        self.compute_logits = compute_logits
        self.vocab_size = vocab_size
        self.device = device
        self.generator = generator
        self.sizes = sorted({max(s, min_rows) for s in capture_sizes(max_rows)})
        rows = self.sizes[-1]
        self.hidden = torch.zeros((rows, hidden_size), dtype=dtype, device=device)
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.buffers = SamplingBuffers(rows, vocab_size, device)
        self.chunk_rows = max(1, CHUNK_ELEMENTS // vocab_size)
        self.slots = RequestSlots(rows, vocab_size, device,
                                  to_device or partial(host_to_device, device=device), history)
        # (padded size, plan, masked, edited) -> graph
        self.graphs: dict[tuple[int, Plan, bool, bool], torch.cuda.CUDAGraph] = {}
        self._pool = None

    def padded_size(self, num_rows: int) -> int:
        """The smallest size of the ladder holding num_rows rows."""
        for size in self.sizes:
            if size >= num_rows:
                return size
        raise ValueError(f"num_rows: {num_rows} exceeds the largest size {self.sizes[-1]}")

    def gather(self, hidden: torch.Tensor, ends: np.ndarray, to_device) -> torch.Tensor:
        """[padded, hidden] rows of `hidden` at the flat indices ends - 1 (each request's
        last token), padded with row 0 up to the padded size."""
        idx = np.zeros(self.padded_size(len(ends)), dtype=np.int64)
        idx[: len(ends)] = ends - 1
        return hidden[to_device(idx)]

    def run(self, size: int, plan: Plan, masked: bool, edited: bool = False) -> None:
        """The post-layer function over the first `size` rows of the buffers: LM head,
        grammar bitmask (when `masked`), the rows' masks, biases and penalties and the count
        of the sampled tokens (when `edited`; penalties when they are served), sampling into
        self.tokens. Capturable: no host read of a device value, shapes fixed by the
        arguments."""
        logits = self.compute_logits(self.hidden[:size]).float()
        if masked:
            apply_dense_bitmask(logits, self.buffers.bitmask(size))
        if edited:
            table_rows = self.buffers.table_rows(size)
            slots = self.slots.slots_of(table_rows)
            self.slots.edit(logits, table_rows, slots)
        # One variant for every edit: rows without penalties read 1 / 0 / 0, which changes
        # nothing, and halving the graphs matters more than the gathers a bias-only step pays.
        penalized = edited and self.slots.counts is not None
        rows = self.buffers.rows(size)
        for lo in range(0, size, self.chunk_rows):
            hi = min(size, lo + self.chunk_rows)
            x = logits[lo:hi]
            if penalized:
                x = self.slots.penalize(x, slots[lo:hi])
            self.tokens[lo:hi] = sample_dense(x, rows.rows(lo, hi), plan, RACE_BLOCK)
        if penalized:
            self.slots.record(slots, self.tokens[:size])

    def sample(
        self,
        hidden_rows: torch.Tensor,
        states: list[CachedRequestState],
        grammar_output: GrammarOutput | None,
        req_ids: list[str],
    ) -> SamplerOutput | None:
        """Samples one token per state (batch order) from `hidden_rows` (from gather): [n]
        int64 on the device (no logprobs), or None (nothing staged, nothing drawn) when a
        request needs the eager path. Raises ValueError on a bitmask that does not fit the
        vocabulary or the batch."""
        if not all(dense_ok(s) for s in states):
            return None
        bitmask, mask_rows = self._bitmask(grammar_output, req_ids)
        step = self.slots.rows(states)
        if step is None:
            return None
        params = [s.sampling_params for s in states]
        positions = [s.num_output_tokens for s in states]
        n, size = len(states), hidden_rows.shape[0]
        all_greedy = all(p.greedy for p in params)
        plan = choose_plan(all_greedy, any(p.top_k != 0 or p.top_p != 1.0 for p in params))
        # Drawn exactly when the Sampler would draw them: the generator stays in step.
        keys = (np.zeros((n, 2), dtype=np.int64) if all_greedy else
                host_noise_keys([p.seed for p in params], positions, self.generator).numpy())
        self.buffers.stage({
            "keys": keys,
            "top_k": np.asarray([p.top_k for p in params], dtype=np.int64),
            "temperature": np.asarray([p.temperature for p in params], dtype=np.float32),
            "top_p": np.asarray([p.top_p for p in params], dtype=np.float32),
            "min_p": np.asarray([p.min_p for p in params], dtype=np.float32),
            "table_rows": step.table_rows,
        }, mask_rows, size, bitmask)
        self.buffers.wait_uploaded()
        self.hidden[:size].copy_(hidden_rows)
        key = (size, plan, bool(mask_rows), step.edited)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            self.run(*key)
        self.slots.advance(step)
        self.buffers.mark_read()
        # A copy: the next step's replay rewrites the output buffer.
        return SamplerOutput(self.tokens[:n].clone(), None)

    def _bitmask(
        self, grammar_output: GrammarOutput | None, req_ids: list[str]
    ) -> tuple[np.ndarray | None, list[int]]:
        if grammar_output is None or not grammar_output.structured_output_request_ids:
            return None, []
        words = grammar_output.grammar_bitmask.shape[-1]
        if words != self.buffers.words:
            raise ValueError(f"grammar_bitmask: {words} words per row cannot mask a "
                             f"vocabulary of {self.vocab_size}")
        return reorder_bitmask(grammar_output, {r: i for i, r in enumerate(req_ids)})

    def capture(self) -> None:
        """Captures run() for every (size, plan, masked, edited), each variant largest size
        first (smaller graphs share its memory pool) and the plain variants first; CUDA
        only. A failed capture logs a warning and ends its variant (its smaller sizes would
        fail alike), not the others: what has no graph runs eagerly."""
        torch.cuda.synchronize()  # the buffers' first upload ran on their own stream
        main = torch.cuda.current_stream()
        stream = torch.cuda.Stream()
        stream.wait_stream(main)
        flags = (False, True)
        variants = [(plan, masked, edited) for masked in flags for edited in flags
                    for plan in Plan]
        with torch.inference_mode(), torch.cuda.stream(stream):
            for variant in variants:
                for size in sorted(self.sizes, reverse=True):
                    if not self._capture_one(stream, (size, *variant)):
                        break
        main.wait_stream(stream)
        logger.info("captured %d post-layer (LM head + sampling) CUDA graphs", len(self.graphs))

    def _capture_one(self, stream, key: tuple[int, Plan, bool, bool]) -> bool:
        try:
            for _ in range(2):  # warm up kernels and the allocator
                self.run(*key)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                self.run(*key)
            self._pool = graph.pool()
            self.graphs[key] = graph
            return True
        except Exception as e:  # noqa: BLE001 - any capture failure means eager
            size, plan, masked, edited = key
            logger.warning("post-layer CUDA graph capture (batch %d, %s, masked %s, edited %s) "
                           "failed; what has no graph runs eagerly: %s", size, plan.value,
                           masked, edited, e)
            torch.cuda.synchronize()
            return False
