"""EAGLE-3 drafting in the model runner, right after a step is sampled (docs/architecture.md §11).

The target copies its auxiliary hidden states into a fixed buffer during each forward
(`LlamaModel.set_aux_layers`); `capture` turns the step's rows into the head's hidden states
(`fc`) and keeps what the head needs until the step is sampled. `propose` then runs, all on
the device:

1. *Catch-up*: the head computes every position the target computed this step, each with
   the token after it: the next input token, or for a sampling request's verified rows the
   tokens verification kept (the last of them the new sample). Its K/V go into the head's
   paged cache at the target's slots, under the target's block table, so they stay as long
   as the target's and prefix caching shares them. Rows past the kept tokens compute garbage
   that the next steps overwrite, as the target's own.
2. *Drafting*: from each sampling request's last kept position, the head's argmax (mapped to
   a target id) is draft 1; each further draft feeds the previous one back with the head's
   own hidden state, one position on. Those positions may lie past the blocks the request
   owns: the block holding its last kept token is its own (not full of confirmed tokens, so
   never shared), and later ones are scratch blocks after the cache's `num_blocks`, one set
   per drafting row, which nothing else reads.

The drafts go back with the step's output (the scheduler cuts and checks them like any
proposer's); under async scheduling the runner also puts them in place of the placeholders
the scheduler drafted for a request whose step was in flight (`fill_drafts`).

A constrained request cannot take placeholders (its grammar must check its drafts before
the step's bitmask is made), so under async scheduling the scheduler drafts for it from
the head's drafts one step stale: they must run past the in-flight step's drafts (up to k)
and a guess of its sample before the k new ones begin. So when a step samples a
constrained request under async scheduling the head drafts 2k + 1 tokens (`chain_length`);
only the first k fill placeholders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.attention.backends.abstract import AttentionMetadata
from vllm.config import VllmConfig
from vllm.model_executor.models.eagle3_head import Eagle3Head
from vllm.v1.spec_decode.verify import NO_TOKEN

if TYPE_CHECKING:
    from vllm.v1.worker.executed_step import ExecutedStep
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.input_prep import StepInputs


@dataclass
class HeadStep:
    """What the head needs of one executed step until it is sampled (copies: a later step
    may reuse the runner's buffers first)."""

    hidden: torch.Tensor  # [T, hidden]: fc over the target's auxiliary states
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, blocks] int32
    cu: np.ndarray  # [R + 1] host query_start_loc
    seq_lens_host: np.ndarray  # [R]
    # [R] int64 on the device: the token after each request's last position where the host
    # knows it (a partial prefill's next prompt token); sampling requests' come from
    # verification.
    after: torch.Tensor
    # Indices (among the R requests) of those that sample, in the runner's sampling order.
    sampled: np.ndarray


class Eagle3Proposer:
    """The runner's EAGLE-3 head, its KV cache and its drafting (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, target: torch.nn.Module,
                 max_num_tokens: int) -> None:
        """Builds the head beside `target` (sharing its embedding when the head has none),
        loads its weights and makes the target keep its auxiliary hidden states. Raises
        ValueError naming a tensor that cannot be read."""
        spec = vllm_config.speculative_config
        assert spec is not None and spec.draft_head is not None
        mc = vllm_config.model_config
        self.num_tokens = spec.num_speculative_tokens
        self.block_size = vllm_config.cache_config.block_size
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.device, self.dtype = mc.device, mc.torch_dtype
        # The longest chain drafted (chain_length): 2k + 1 under async scheduling.
        self.max_depth = (2 * self.num_tokens + 1
                          if vllm_config.scheduler_config.async_scheduling else self.num_tokens)
        # Drafted positions run up to max_depth past the last kept one.
        max_position = mc.max_model_len + self.max_depth + 1
        with torch.device(self.device):
            head = Eagle3Head(spec.draft_head, target.attn_backend_cls, max_position,
                              target.model.embed_tokens)
        self.head = head.to(self.dtype)
        self.head.load_weights()
        self.head.eval()
        target.model.set_aux_layers(spec.draft_head.aux_layer_ids, max_num_tokens)
        self.aux = target.model
        self.reads_host_lengths = target.attn_backend_cls.reads_host_lengths
        # Scratch blocks per drafting row: drafted positions past the last kept one's block.
        self.scratch_blocks = (self.max_depth - 1) // self.block_size + 1
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        # Newest drafts per request id: (the step's [n, K] tensor, the request's row in it).
        self._latest: dict[str, tuple[torch.Tensor, int]] = {}
        # Whether fill_drafts replaced placeholders in the step being executed.
        self._filled = False

    def block_bytes(self) -> int:
        """Bytes the head's cache takes per KV block of the target (all its layers)."""
        head = self.head
        return (head.num_layers * self.block_size * 2 * head.num_kv_heads * head.head_dim
                * self.dtype.itemsize)

    def init_cache(self, num_blocks: int,
                   alloc: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
                   ) -> None:
        """Allocates the head's paged cache: the target's `num_blocks`, then the scratch
        blocks of every row, with `alloc` (a zeroed tensor)."""
        self.num_blocks = num_blocks
        total = num_blocks + self.max_num_reqs * self.scratch_blocks
        shape = self.head.attn_backend_cls.kv_cache_shape(
            total, self.block_size, self.head.num_kv_heads, self.head.head_dim)
        self.kv_caches = [alloc(shape, self.dtype, self.device)
                          for _ in range(self.head.num_layers)]

    def chain_length(self, constrained: bool) -> int:
        """How many tokens to draft after a step: 2k + 1 when it samples a constrained
        request under async scheduling (module docstring), else k."""
        return self.max_depth if constrained else self.num_tokens

    def forget(self, req_ids: set[str]) -> None:
        """Drops the newest drafts of finished requests."""
        for req_id in req_ids:
            self._latest.pop(req_id, None)

    def fill_drafts(self, inputs: StepInputs, wanted: set[str], input_ids: torch.Tensor) -> None:
        """Writes each request's newest drafts over the placeholder drafts the scheduler gave
        it, in the staged `input_ids`, for the requests in `wanted` (scheduled while their
        step was in flight). A request without newer drafts keeps its placeholders."""
        self._filled = False
        if not wanted or inputs.drafts is None:
            return
        for i, req_id in enumerate(inputs.req_ids):
            latest = self._latest.get(req_id)
            n = len(inputs.drafts[i])
            if req_id not in wanted or latest is None or not n:
                continue
            table, row = latest
            end = int(inputs.cu[i + 1])
            input_ids[end - n : end] = table[row, :n]
            self._filled = True

    @torch.inference_mode()
    def capture(self, step: ExecutedStep, inputs: StepInputs, dev: dict[str, torch.Tensor],
                batch: InputBatch) -> None:
        """Keeps in `step.head` what `propose` needs of the forward that just ran over the
        staged inputs `dev`, and in `step.guesses` the drafts as verified when fill_drafts
        replaced some."""
        num_reqs, num_tokens = inputs.num_reqs, inputs.num_tokens
        assert self.aux.aux_hidden is not None
        sampled = set(step.sampled_req_ids)
        picks = np.asarray([i for i, r in enumerate(inputs.req_ids) if r in sampled],
                           dtype=np.int64)
        # The token after each request's last position, where the host knows it.
        rows = inputs.rows_np
        nxt = (inputs.starts + inputs.num_sched).astype(np.int64)
        known = nxt < batch.num_known_tokens[rows]
        after = np.where(known, batch.token_ids[rows, np.where(known, nxt, 0)], 0)
        max_len = max(1, int(inputs.seq_lens[:num_reqs].max()))
        step.head = HeadStep(
            hidden=self.head.combine(self.aux.aux_hidden[:num_tokens]),
            input_ids=dev["input_ids"][:num_tokens].clone(),
            positions=dev["positions"][:num_tokens].clone(),
            slot_mapping=dev["slot_mapping"][:num_tokens].clone(),
            query_start_loc=dev["query_start_loc"][: num_reqs + 1].clone(),
            seq_lens=dev["seq_lens"][:num_reqs].clone(),
            # Only the blocks the step's positions reach (drafting starts inside them).
            block_table=dev["block_table"][:num_reqs, : -(-max_len // self.block_size)].clone(),
            cu=inputs.cu[: num_reqs + 1].copy(), seq_lens_host=inputs.seq_lens[:num_reqs].copy(),
            after=_dev(after.astype(np.int64), self.device), sampled=picks,
        )
        if self._filled:
            step.guesses = self._guesses(step.drafts, inputs.cu[1:][picks], dev["input_ids"])

    def _guesses(self, drafts: list[list[int]], ends: np.ndarray,
                 input_ids: torch.Tensor) -> torch.Tensor:
        """[len(drafts), max drafts] on the device: the draft inputs of each sampling request
        (the last len(drafts[j]) before ends[j]), padded with NO_TOKEN - 1."""
        counts = np.asarray([len(d) for d in drafts], dtype=np.int64)
        cols = np.arange(max(1, int(counts.max())), dtype=np.int64)
        used = cols[None, :] < counts[:, None]
        index = np.where(used, (ends - counts)[:, None] + cols[None, :], 0)
        out = input_ids[_dev(index, self.device)]
        return torch.where(_dev(used, self.device), out, torch.full_like(out, NO_TOKEN - 1))

    @torch.inference_mode()
    def propose(self, step: HeadStep, kept: torch.Tensor | None, num_rows: list[int],
                req_ids: list[str], depth: int | None = None) -> torch.Tensor | None:
        """The drafts [len(req_ids), depth] (target ids, on the device; depth: k unless
        given, at most chain_length's longest) after each sampling request's kept tokens:
        `kept` is verification's table ([n, width], the kept ids of row j then NO_TOKEN),
        `num_rows` its rows per request; None when no request sampled (prompt chunks only:
        the cache is caught up, nothing is drafted).
        Side effect: the head's cache holds the step's positions; the drafts become each
        request's newest."""
        head, device = self.head, self.device
        depth = self.num_tokens if depth is None else depth
        assert 1 <= depth <= self.max_depth
        num_tokens = len(step.input_ids)
        num_reqs = len(step.after)
        ends = step.cu[1 : num_reqs + 1].astype(np.int64)
        nxt = torch.empty_like(step.input_ids)
        nxt[:-1] = step.input_ids[1:]
        nxt[_dev(ends - 1, device)] = step.after
        rows = np.asarray(num_rows, dtype=np.int64)
        first = ends[step.sampled] - rows  # flat index of each sampling request's first row
        if kept is not None:
            cols = np.arange(kept.shape[1], dtype=np.int64)
            # Index lists known on the host: a boolean mask would make the device sync.
            which, col = np.nonzero(cols[None, :] < rows[:, None])
            nxt[_dev(first[which] + col, device)] = kept[_dev(which, device),
                                                         _dev(col, device)].clamp(min=0)
        metadata = AttentionMetadata(
            num_actual_tokens=num_tokens, num_reqs=num_reqs,
            max_query_len=int(np.diff(step.cu).max()), max_seq_len=int(step.seq_lens_host.max()),
            query_start_loc=step.query_start_loc, seq_lens=step.seq_lens,
            block_table=step.block_table, slot_mapping=step.slot_mapping,
            query_start_loc_cpu=torch.from_numpy(step.cu),
            seq_lens_cpu=torch.from_numpy(step.seq_lens_host),
        )
        out = head(nxt, step.hidden, step.positions, self.kv_caches, metadata)
        if kept is None:
            return None
        accepted = (kept != NO_TOKEN).sum(dim=1) - 1
        last = _dev(first, device) + accepted
        hidden = out[last]
        position = step.positions[last]
        table = step.block_table[_dev(step.sampled, device)]
        drafts = [head.d2t_ids[head.compute_logits(hidden).argmax(dim=-1)]]
        if depth > 1:
            table = self._draft_table(table, position)
            bound = int(step.seq_lens_host.max()) + depth
            hidden = head.carry(hidden)
            for _ in range(depth - 1):
                position = position + 1
                out = head(drafts[-1], hidden, position, self.kv_caches,
                           self._draft_metadata(table, position, bound))
                drafts.append(head.d2t_ids[head.compute_logits(out).argmax(dim=-1)])
                hidden = head.carry(out)
        result = torch.stack(drafts, dim=1)
        for i, req_id in enumerate(req_ids):
            self._latest[req_id] = (result, i)
        return result

    def _draft_table(self, table: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Each drafting row's block table for positions past `position` (its last kept
        one): its own blocks up to the one holding that position, then its scratch blocks."""
        n = table.shape[0]
        width = table.shape[1] + self.scratch_blocks
        cols = torch.arange(width, device=table.device)[None, :]
        own = (position // self.block_size)[:, None]
        rows = torch.arange(n, device=table.device)[:, None]
        scratch = self.num_blocks + rows * self.scratch_blocks + (cols - own - 1)
        padded = torch.nn.functional.pad(table, (0, self.scratch_blocks))
        return torch.where(cols > own, scratch, padded.to(scratch.dtype)).to(torch.int32)

    def _draft_metadata(self, table: torch.Tensor, position: torch.Tensor,
                        bound: int) -> AttentionMetadata:
        """One query per drafting row at `position`, seeing every position up to it."""
        n, bs = table.shape[0], self.block_size
        rows = torch.arange(n, device=table.device)
        slots = table[rows, position // bs].to(torch.int64) * bs + position % bs
        seq_lens = (position + 1).to(torch.int32)
        cu = torch.arange(n + 1, dtype=torch.int32, device=table.device)
        # Host lengths cost a sync on a GPU; only a backend that reads them gets them.
        host = self.reads_host_lengths or table.device.type == "cpu"
        return AttentionMetadata(
            num_actual_tokens=n, num_reqs=n, max_query_len=1, max_seq_len=bound,
            query_start_loc=cu, seq_lens=seq_lens, block_table=table, slot_mapping=slots,
            query_start_loc_cpu=cu.cpu() if host else torch.arange(n + 1, dtype=torch.int32),
            seq_lens_cpu=seq_lens.cpu() if host else torch.full((n,), bound, dtype=torch.int32),
        )


def _dev(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on the device without blocking the host."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)
