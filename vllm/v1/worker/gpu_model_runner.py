"""The model runner: builds flat varlen inputs from a SchedulerOutput, runs the model, samples.

`execute_model` runs the forward pass and keeps the logits of the rows that sample this step;
`sample_tokens` applies the grammar bitmask (if any) and samples. Between the two, the engine
computes the bitmask on the CPU while the forward runs. Several steps may be executed before
the oldest is sampled (a deferred structured-output step, docs/architecture.md §4): the runner
keeps them first in, first out, and each sample_tokens call samples the oldest.

Sampled ids stay on the device: the next step's input for a request whose newest token is not
on the host yet is copied from `last_token` on the device, so building a step never waits for
the previous one (this is what makes async scheduling possible). Likewise a request verified
with drafts starts its next step after the tokens it kept, placed on the device from the
verification's kept count (`_place_after_kept`). A step must not feed a request whose
previous step is executed but not sampled yet: the scheduler never schedules one
(AsyncScheduler).

With pipeline stages (docs/architecture.md §10) each rank runs its stage's layers: a stage
other than the first receives the hidden states and residual of the previous one, a stage
other than the last sends its own to the next, and only the last stage computes logits and
samples. The first stage never sees a sample, so there every rank learns a request's tokens
from the scheduler output instead (the scheduler never runs a request in two in-flight
steps under pipeline parallelism). With tensor parallelism every rank of the last stage
samples the same gathered logits; rank 0's tokens are broadcast so the ranks cannot drift.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm import _custom_ops as ops
from vllm.attention.backends.abstract import AttentionMetadata
from vllm.config import VllmConfig
from vllm.distributed.parallel_state import ParallelContext
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    AsyncModelRunnerOutput,
    LogprobsLists,
    ModelRunnerOutput,
)
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import LogprobsTensors, Sampler
from vllm.v1.spec_decode.verify import NO_TOKEN, verify_drafts
from vllm.v1.worker.cuda_graph import DecodeGraphs, capture_sizes
from vllm.v1.worker.gpu_input_batch import (
    SAMPLING_FLOAT_DTYPE,
    TOP_K_DTYPE,
    CachedRequestState,
    InputBatch,
)
from vllm.v1.worker.input_buffers import InputBuffers

if TYPE_CHECKING:
    from vllm.lora.model_manager import LoRAModelManager

logger = logging.getLogger(__name__)

# CPU GEMMs give row results that depend on the row count below ~12 rows; padding every
# matmul to at least this many rows makes a request's numbers independent of its batch, which
# async = sync equivalence relies on.
_CPU_MIN_ROWS = 16


# Logits elements one slice of prompt_logprobs may hold (each is a few float32 temporaries).
_PROMPT_LOGPROBS_ELEMENTS = 1 << 25


@dataclass
class _Step:
    """What execute_model leaves for sample_tokens."""

    req_ids: list[str]  # scheduled requests, batch order
    sampled_req_ids: list[str]  # the requests that sample, batch order
    # Their states, kept by reference rather than by batch row: a later step's forward may
    # run before this step is sampled, and it can move rows or drop finished and preempted
    # requests.
    sampled_states: list[CachedRequestState]
    # Drafted tokens of each sampling request ([] for most), verified by this step.
    drafts: list[list[int]]
    # [sum(1 + len(d) for d in drafts), vocab] float32: a row per verified position.
    logits: torch.Tensor | None
    # Steps with drafts: [len(drafts)] int64 on the device, the position of each sampling
    # request's last input before its drafts (where its newest kept token goes from).
    draft_bases: torch.Tensor | None = None
    # Requests with prompt_logprobs: the part of the prompt this step computed.
    prompt_logprobs: dict[str, tuple[int, LogprobsLists]] | None = None

    @property
    def num_rows(self) -> list[int]:
        return [1 + len(d) for d in self.drafts]


class _SampledTokens:
    """A step's sampled ids (and logprobs) with their device-to-host copy in flight."""

    def __init__(
        self,
        req_ids: list[str],
        states: list[CachedRequestState],
        positions: list[int],
        token_ids: torch.Tensor,
        logprobs: LogprobsTensors | None,
        copy_stream,
        drafts: list[list[int]],
    ) -> None:
        self.req_ids = req_ids
        # The states verified with drafts: how many tokens they kept is on the device only.
        self.verified = {id(state) for state, d in zip(states, drafts) if d}
        # The first new id of each request on the device (penalties read them before the
        # host copy; requests with penalties never draft, so they have only that one).
        self.device_token_ids = token_ids[:, 0]
        # The states sampled for: a finished id may be reused by a new request meanwhile.
        self.states = states
        # Output index of each row's first token: a resumed request may already hold it.
        self.positions = positions
        self._event = None
        # [len(req_ids), 1 + most drafts]: the kept ids of each request, then NO_TOKEN.
        tensors = [token_ids]
        if logprobs is not None:
            tensors += [logprobs.token_ids, logprobs.logprobs, logprobs.ranks]
        if copy_stream is None:
            self._host = tensors
            return
        # Copy on a side stream so the compute stream can start the next forward at once.
        main = torch.cuda.current_stream()
        copy_stream.wait_stream(main)
        with torch.cuda.stream(copy_stream):
            self._host = [t.to("cpu", non_blocking=True) for t in tensors]
            for t in tensors:
                t.record_stream(copy_stream)
            self._event = torch.cuda.Event()
            self._event.record(copy_stream)

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def token_lists(self) -> list[list[int]]:
        """Each request's new token ids (one, or more after a verification with drafts)."""
        self.wait()
        return [[t for t in row if t != NO_TOKEN] for row in self._host[0].tolist()]

    def logprobs(self) -> LogprobsLists | None:
        self.wait()
        if len(self._host) == 1:
            return None
        ids, lps, ranks = self._host[1:]
        return LogprobsLists(ids.tolist(), lps.tolist(), ranks.tolist())


class _AsyncOutput(AsyncModelRunnerOutput):
    def __init__(
        self,
        req_ids: list[str],
        sampled_req_ids: list[str],
        sampled: _SampledTokens,
        prompt_logprobs: dict[str, tuple[int, LogprobsLists]] | None = None,
    ):
        self._req_ids = req_ids
        self._sampled_req_ids = sampled_req_ids
        self._sampled = sampled
        self._prompt_logprobs = prompt_logprobs

    def get_output(self) -> ModelRunnerOutput:
        tokens = dict(zip(self._sampled_req_ids, self._sampled.token_lists()))
        lp = self._sampled.logprobs()
        if lp is not None:
            # Rows of the sampler output follow sampled_req_ids; the output follows req_ids.
            order = {r: i for i, r in enumerate(self._sampled_req_ids)}
            idx = [order.get(r) for r in self._req_ids]
            lp = LogprobsLists(
                [lp.token_ids[i] if i is not None else [] for i in idx],
                [lp.logprobs[i] if i is not None else [] for i in idx],
                [lp.ranks[i] if i is not None else 0 for i in idx],
            )
        return ModelRunnerOutput(
            req_ids=self._req_ids,
            sampled_token_ids=[tokens.get(r, []) for r in self._req_ids],
            logprobs=lp,
            prompt_logprobs=self._prompt_logprobs,
        )


class GPUModelRunner:
    """Runs one model on one device (CUDA when present, else CPU) for the engine core."""

    def __init__(self, vllm_config: VllmConfig, parallel: ParallelContext | None = None) -> None:
        self.config = vllm_config
        self.parallel = parallel or ParallelContext.single()
        layout = self.parallel.layout
        # Tokens come from the scheduler output rather than from this rank's own samples.
        self.pipelined = layout.pp_size > 1
        self.first_stage = layout.is_first_stage
        self.last_stage = layout.is_last_stage
        mc = vllm_config.model_config
        self.device = mc.device
        self.dtype = mc.torch_dtype
        self.block_size = vllm_config.cache_config.block_size
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.async_scheduling = vllm_config.scheduler_config.async_scheduling
        # Speculative decoding: some steps verify drafts.
        self.speculative = vllm_config.speculative_config is not None
        self.vocab_size = mc.vocab_size
        self.min_rows = _CPU_MIN_ROWS if self.device.type == "cpu" else 1
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()
        self.input_batch = InputBatch(self.max_num_reqs, mc.max_model_len, self.block_size)
        self.requests: dict[str, CachedRequestState] = {}
        # Newest sampled token per batch row, kept on the device (see module docstring).
        self.last_token = torch.zeros(self.max_num_reqs, dtype=torch.int64, device=self.device)
        # Per batch row verified with drafts: the position of its newest kept token, where
        # its next forward starts (`_place_after_kept`).
        self.next_start = torch.zeros(self.max_num_reqs, dtype=torch.int64, device=self.device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(mc.seed)
        self.copy_stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        self._unsettled: deque[_SampledTokens] = deque()
        # Executed steps not sampled yet, oldest first (see module docstring).
        self._steps: deque[_Step] = deque()
        sched = vllm_config.scheduler_config
        self.buffers = InputBuffers(
            max(sched.max_num_batched_tokens, self.max_num_reqs, self.min_rows),
            self.max_num_reqs,
            self.input_batch.max_num_blocks,
            self.device,
        )
        self.graphs: DecodeGraphs | None = None
        # LoRA slots of the model's layers (None: LoRA is off).
        self.lora: LoRAModelManager | None = None

    # ------------------------------------------------------------------ setup

    def load_model(self) -> None:
        """Builds the model and loads its weights onto the device."""
        from vllm.model_executor.model_loader.loader import get_model

        self.model = get_model(self.config.model_config, self.parallel)
        if self.config.lora_config is not None:
            from vllm.lora.model_manager import LoRAModelManager

            self.lora = LoRAModelManager(
                self.model, self.config.lora_config, self.device, self.dtype, self.min_rows,
                self.buffers.to_device,
            )

    def kv_cache_block_bytes(self) -> int:
        """Bytes one KV block takes across all layers."""
        assert self.model is not None
        per_token = 2 * self.model.num_kv_heads * self.model.head_dim * self.dtype.itemsize
        return self.model.num_layers * self.block_size * per_token

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocates the paged KV cache (zeroed: padded attention reads must not see NaNs)."""
        assert self.model is not None
        shape = self.model.attn_backend_cls.kv_cache_shape(
            num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim
        )
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(self.model.num_layers)
        ]
        if (
            self.device.type == "cuda"
            and not self.config.model_config.enforce_eager
            and self.parallel.layout.world_size == 1
            and self.model.attn_backend_cls.__name__ == "TritonAttentionBackend"
            and getattr(self.model, "supports_cuda_graphs", True)
            # Each step's adapter rows are host-built index lists a graph cannot replay.
            and self.lora is None
        ):
            self._capture_graphs()

    # ------------------------------------------------------------------ state

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        # Sorted: a set of ids iterates in a per-process order, and every rank of a parallel
        # engine must move its rows identically (the ranks exchange tensors row by row).
        for req_id in sorted(scheduler_output.finished_req_ids):
            self.requests.pop(req_id, None)
            self._remove_row(req_id)
        for req_id in sorted(scheduler_output.preempted_req_ids):
            self._remove_row(req_id)
        for req_id, kept in scheduler_output.num_kept_blocks.items():
            # Blocks of rejected drafts went back to the pool: they may be someone else's now.
            state = self.requests.get(req_id)
            if state is not None:
                del state.block_ids[kept:]
                row = batch.req_id_to_index.get(req_id)
                if row is not None:
                    batch.num_blocks[row] = min(int(batch.num_blocks[row]), kept)
        for new in scheduler_output.scheduled_new_reqs:
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                lora_request=new.lora_request,
            )
            self.requests[new.req_id] = state
            batch.add(state)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if cached.resumed_from_preemption[i]:
                state.verified_drafts = False  # recomputed from the scheduler's count
                tokens = cached.resumed_req_token_ids[req_id]
                num_out = cached.resumed_num_output_tokens[req_id]
                state.output_token_ids = tokens[len(tokens) - num_out :]
                state.num_output_tokens = num_out
                state.block_ids = list(cached.new_block_ids[i])
                self._remove_row(req_id)
                batch.add(state)
            else:
                state.block_ids.extend(cached.new_block_ids[i])
                row = batch.req_id_to_index[req_id]
                batch.append_blocks(row, cached.new_block_ids[i])
                batch.num_computed_tokens[row] = state.num_computed_tokens
                new_tokens = cached.new_token_ids.get(req_id)
                if new_tokens:
                    state.output_token_ids.extend(new_tokens)
                    batch.append_tokens(row, new_tokens)

    def _remove_row(self, req_id: str) -> None:
        moved = self.input_batch.remove(req_id)
        if moved is not None:
            src, dst = moved
            self.last_token[dst] = self.last_token[src]
            self.next_start[dst] = self.next_start[src]

    def _settle(self, block: bool) -> None:
        """Moves sampled token values that reached the host into the request states."""
        while self._unsettled and (block or self._unsettled[0].ready()):
            sampled = self._unsettled.popleft()
            for req_id, sampled_state, position, tokens in zip(
                sampled.req_ids, sampled.states, sampled.positions, sampled.token_lists()
            ):
                state = self.requests.get(req_id)
                if state is not sampled_state or position != len(state.output_token_ids):
                    continue  # finished, or resumed from preemption with this token already
                # sample_tokens counted one token; a verification may have kept more.
                state.num_output_tokens += len(tokens) - 1
                state.output_token_ids.extend(tokens)
                row = self.input_batch.req_id_to_index.get(req_id)
                if row is not None and self.input_batch.states[row] is state:
                    self.input_batch.append_tokens(row, tokens)

    # ------------------------------------------------------------------ forward

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Runs the forward pass of one step and queues the logits of its sampling rows for
        sample_tokens (every call is matched by one sample_tokens call, in order)."""
        self._update_states(scheduler_output)
        batch = self.input_batch
        if scheduler_output.total_num_scheduled_tokens == 0:
            self._steps.append(_Step([], [], [], [], None))
            return None
        scheduled = scheduler_output.num_scheduled_tokens
        rows = [r for r, req_id in enumerate(batch.req_ids) if req_id in scheduled]
        req_ids = [batch.req_ids[r] for r in rows]
        rows_np = np.asarray(rows, dtype=np.int32)
        num_sched = np.asarray([scheduled[r] for r in req_ids], dtype=np.int32)
        starts = batch.num_computed_tokens[rows_np]
        verified = self._take_verified(rows)
        num_reqs, num_tokens = len(rows), int(num_sched.sum())
        graph_size = None
        if self.graphs is not None and num_tokens == num_reqs:
            graph_size = self.graphs.padded_size(num_reqs)
        padded_tokens = graph_size or max(num_tokens, self.min_rows)
        padded_reqs = graph_size or num_reqs

        local_idx = np.empty(num_tokens, dtype=np.int32)
        positions = np.zeros(padded_tokens, dtype=np.int64)
        ops.prepare_positions(starts, num_sched, local_idx, positions[:num_tokens])
        req_indices = rows_np[local_idx]
        known = positions[:num_tokens] < batch.num_known_tokens[req_indices]
        token_ids = np.zeros(padded_tokens, dtype=np.int64)
        token_ids[:num_tokens] = np.where(
            known, batch.token_ids[req_indices, np.where(known, positions[:num_tokens], 0)], 0
        )
        cu = np.full(padded_reqs + 1, num_tokens, dtype=np.int32)
        cu[0] = 0
        np.cumsum(num_sched, out=cu[1 : num_reqs + 1])
        spec = scheduler_output.scheduled_spec_decode_tokens
        drafts = [spec.get(r, []) for r in req_ids] if spec else None
        if drafts is not None:
            # Drafts follow the request's one regular token, at the end of its segment.
            for i, tokens in enumerate(drafts):
                if tokens:
                    end = int(cu[i + 1])
                    token_ids[end - len(tokens) : end] = tokens
                    known[end - len(tokens) : end] = True
        slot_mapping = np.full(padded_tokens, -1, dtype=np.int64)
        ops.compute_slot_mapping(
            batch.block_table, req_indices, positions[:num_tokens], self.block_size,
            slot_mapping[:num_tokens],
        )
        # Padded requests (graph replays) own no query tokens and no context (cu above).
        seq_lens = np.zeros(padded_reqs, dtype=np.int32)
        seq_lens[:num_reqs] = starts + num_sched
        block_table = np.zeros((padded_reqs, batch.max_num_blocks), dtype=np.int32)
        block_table[:num_reqs] = batch.block_table[rows_np]
        dev = self.buffers.stage(
            {
                "input_ids": token_ids,
                "positions": positions,
                "slot_mapping": slot_mapping,
                "query_start_loc": cu,
                "seq_lens": seq_lens,
                "block_table": block_table,
            }
        )
        if verified:
            self._place_after_kept(dev, verified, rows_np, cu, num_sched, seq_lens)
        input_ids = dev["input_ids"]
        # Device-side feedback: tokens not on the host yet come from the previous samples.
        unknown = np.nonzero(~known)[0]
        if len(unknown) and self.pipelined:
            # The scheduler sends every token before a request runs again (module docstring).
            raise RuntimeError(
                f"pipeline stage {self.parallel.layout.pp_rank}: {len(unknown)} input tokens "
                "were never sent by the scheduler"
            )
        if len(unknown):
            src = self.buffers.to_device(req_indices[unknown].astype(np.int64))
            dst = self.buffers.to_device(unknown.astype(np.int64))
            input_ids[dst] = self.last_token[src]
        assert self.model is not None
        if self.lora is not None:
            self._set_lora_rows(rows, num_sched, padded_tokens)
        intermediate = None
        if not self.first_stage:
            # One message per step: (hidden, residual) stacked.
            shape = (2, padded_tokens, self.model.hidden_size)
            received = self.parallel.recv_prev(shape, self.dtype, self.device)
            intermediate = (received[0], received[1])
        if graph_size is not None:
            hidden = self.graphs.replay(graph_size)
        else:
            metadata = AttentionMetadata(
                num_actual_tokens=num_tokens,
                num_reqs=num_reqs,
                max_query_len=int(num_sched.max()),
                max_seq_len=int(seq_lens.max()),
                query_start_loc=dev["query_start_loc"],
                seq_lens=dev["seq_lens"],
                block_table=dev["block_table"],
                slot_mapping=dev["slot_mapping"],
                query_start_loc_cpu=torch.from_numpy(cu),
                seq_lens_cpu=torch.from_numpy(seq_lens),
            )
            hidden = self.model(
                input_ids, dev["positions"], self.kv_caches, metadata, intermediate
            )
        batch.num_computed_tokens[rows_np] = seq_lens[:num_reqs]
        if not self.last_stage:
            self.parallel.send_next(torch.stack(hidden))

        sampled = set(scheduler_output.sampled_req_ids)
        pick = [i for i, r in enumerate(req_ids) if r in sampled]
        step_drafts = [drafts[i] if drafts is not None else [] for i in pick]
        logits = draft_bases = None
        if pick and self.last_stage:
            # The last position of each sampling request, and the ones of its drafts before it.
            ends = cu[1:][pick]
            counts = np.asarray([1 + len(d) for d in step_drafts], dtype=np.int64)
            num_rows = int(counts.sum())
            idx = np.zeros(max(num_rows, self.min_rows), dtype=np.int64)
            idx[:num_rows] = np.repeat(ends - counts, counts) + (
                np.arange(num_rows) - np.repeat(np.cumsum(counts) - counts, counts)
            )
            logits = self.model.compute_logits(hidden[self.buffers.to_device(idx)])
            logits = logits[:num_rows]
            if num_rows > len(pick):
                # Read from the device: this forward's own positions may have been placed there.
                draft_bases = dev["positions"][self.buffers.to_device(ends - counts)]
        prompt_lps = None
        if self.last_stage:
            prompt_lps = self._prompt_logprobs(hidden, rows, starts, num_sched, cu)
        self._steps.append(
            _Step(
                req_ids=req_ids,
                sampled_req_ids=[req_ids[i] for i in pick],
                sampled_states=[batch.states[rows[i]] for i in pick],
                drafts=step_drafts,
                logits=logits,
                draft_bases=draft_bases,
                prompt_logprobs=prompt_lps,
            )
        )
        self._settle(block=False)
        return None

    def _set_lora_rows(self, rows: list[int], num_sched: np.ndarray, num_padded: int) -> None:
        """Puts this step's adapters into LoRA slots and gives each token row its slot
        (padding rows and base-model requests: -1)."""
        assert self.lora is not None
        states = self.input_batch.states
        slots = self.lora.activate([states[r].lora_request for r in rows])
        token_slots = np.full(num_padded, -1, dtype=np.int64)
        token_slots[: int(num_sched.sum())] = np.repeat(slots, num_sched)
        self.lora.set_token_slots(token_slots)

    def _take_verified(self, rows: list[int]) -> list[int]:
        """Indices into `rows` of the requests verified with drafts since their last forward;
        clears their marks (this forward places them)."""
        if not self.speculative:
            return []
        states = self.input_batch.states
        verified = [i for i, row in enumerate(rows) if states[row].verified_drafts]
        for i in verified:
            states[rows[i]].verified_drafts = False
        return verified

    def _place_after_kept(
        self,
        dev: dict[str, torch.Tensor],
        verified: list[int],
        rows: np.ndarray,
        cu: np.ndarray,
        num_sched: np.ndarray,
        seq_lens: np.ndarray,
    ) -> None:
        """Moves the inputs of the requests `verified` (indices into this step's requests, whose
        batch rows are `rows`) to start just after the tokens they kept: positions, KV slots
        and sequence lengths in the staged device tensors `dev`.

        Under async scheduling such a request may be scheduled before the scheduler learns
        how many drafts it kept; its computed-token count then assumes all were (an upper
        bound, so its blocks suffice, and its first input, unknown to the host at that
        position, comes from `last_token`). The kept count is on the device as soon as the
        verification is sampled, so no step waits for its host copy (docs/architecture.md
        §11). On the CPU the staged tensors are the host arrays, which change with them; off
        the CPU, an attention backend that reads host lengths waits for the corrected ones.
        """
        to_device = self.buffers.to_device
        reqs = np.asarray(verified, dtype=np.int64)
        counts, firsts = num_sched[reqs], cu[reqs]
        # Token j of verified request k sits at flat index firsts[k] + j (its k in `owner`).
        owner = np.empty(int(counts.sum()), dtype=np.int32)
        flat = np.empty(len(owner), dtype=np.int64)
        ops.prepare_positions(firsts, counts, owner, flat)
        owner = owner.astype(np.int64)
        offsets = flat - firsts[owner]
        tokens = to_device(flat)
        start = self.next_start[to_device(rows[reqs].astype(np.int64))]
        if self.buffers.on_cpu:
            # The scheduler's start is an upper bound; beyond it the blocks may not be ours.
            # (Checked where it costs no device sync.)
            scheduled = seq_lens[reqs] - counts
            if (start.numpy() > scheduled).any():
                raise RuntimeError(
                    f"requests {[int(r) for r in rows[reqs]]}: kept tokens end at "
                    f"{start.tolist()}, past the scheduled starts {scheduled.tolist()}"
                )
        positions = start[to_device(owner)] + to_device(offsets)
        dev["positions"][tokens] = positions
        blocks = dev["block_table"][to_device(reqs[owner]), positions // self.block_size]
        dev["slot_mapping"][tokens] = (
            blocks.to(torch.int64) * self.block_size + positions % self.block_size
        )
        lengths = (start + to_device(counts)).to(dev["seq_lens"].dtype)
        dev["seq_lens"][to_device(reqs)] = lengths
        if self.model.attn_backend_cls.reads_host_lengths and not self.buffers.on_cpu:
            seq_lens[reqs] = lengths.cpu().numpy()

    def _capture_graphs(self) -> None:
        """Captures decode graphs over the persistent input buffers (CUDA only)."""
        assert self.model is not None
        graphs = DecodeGraphs(capture_sizes(self.max_num_reqs))
        max_blocks = self.input_batch.max_num_blocks
        max_len = self.config.model_config.max_model_len

        def prepare(size: int) -> None:
            self.buffers.stage(
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
            buf = self.buffers.device_buffers
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
            return self.model(buf["input_ids"][:size], buf["positions"][:size], self.kv_caches,
                              metadata)

        with torch.inference_mode():
            graphs.capture(prepare, run)
        if graphs.graphs:
            self.graphs = graphs
        logger.info("captured CUDA graphs for decode batch sizes %s", sorted(graphs.graphs))

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        rows: list[int],
        starts: np.ndarray,
        num_sched: np.ndarray,
        cu: np.ndarray,
    ) -> dict[str, tuple[int, LogprobsLists]] | None:
        """For each request of this step with prompt_logprobs: the logprob, rank and top-k of
        every prompt token its computed positions predict. Reads them back to the host (a
        wait on non-CPU devices, paid only by steps that hold such requests)."""
        batch = self.input_batch
        out: dict[str, tuple[int, LogprobsLists]] = {}
        for i, row in enumerate(rows):
            state = batch.states[row]
            k = state.sampling_params.prompt_logprobs
            prompt = state.prompt_token_ids
            first, end = int(starts[i]), int(starts[i]) + int(num_sched[i])
            last = min(end, len(prompt) - 1)  # position p predicts prompt[p + 1]
            if k is None or first >= last:
                continue
            lists = LogprobsLists([], [], [])
            # Vocabulary-sized temporaries per position: a long prompt goes in slices.
            step = max(1, _PROMPT_LOGPROBS_ELEMENTS // self.vocab_size)
            for lo in range(first, last, step):
                hi = min(last, lo + step)
                start = int(cu[i]) + lo - first
                idx = self.buffers.to_device(np.arange(start, start + hi - lo, dtype=np.int64))
                lp = torch.log_softmax(self.model.compute_logits(hidden[idx]).float(), dim=1)
                target = self.buffers.to_device(np.asarray(prompt[lo + 1 : hi + 1], np.int64))
                chosen = lp.gather(1, target[:, None])
                lists.ranks += ((lp > chosen).sum(dim=1) + 1).tolist()
                ids, values = target[:, None], chosen
                if k > 0:
                    top_values, top_ids = torch.topk(lp, k, dim=1)
                    ids = torch.cat([ids, top_ids], 1)
                    values = torch.cat([values, top_values], 1)
                lists.token_ids += ids.tolist()
                lists.logprobs += values.tolist()
            out[batch.req_ids[row]] = (first + 1, lists)
        return out or None

    # ------------------------------------------------------------------ sampling

    @torch.inference_mode()
    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Samples the oldest executed-but-unsampled step. Applies the grammar bitmask to
        the constrained rows only. Side effect: the sampled ids become the inputs of the
        requests' next steps."""
        if not self._steps:
            raise RuntimeError("sample_tokens called without an executed, unsampled step")
        step = self._steps.popleft()
        if step.sampled_req_ids and not self.last_stage:
            # Only the last stage samples; the engine reads its answer, not this one.
            for state in step.sampled_states:
                state.num_output_tokens += 1
            return EMPTY_MODEL_RUNNER_OUTPUT
        if step.logits is None:
            out = ModelRunnerOutput(
                req_ids=step.req_ids,
                sampled_token_ids=[[] for _ in step.req_ids],
                prompt_logprobs=step.prompt_logprobs,
            )
            return out if step.req_ids else EMPTY_MODEL_RUNNER_OUTPUT
        logits = step.logits
        num_rows = step.num_rows
        self._settle_verified(step.sampled_states)
        first_rows = np.cumsum([0] + num_rows[:-1]).tolist()
        if grammar_output is not None:
            from vllm.v1.worker.grammar_bitmask import apply_grammar_bitmask

            apply_grammar_bitmask(
                logits, grammar_output, dict(zip(step.sampled_req_ids, first_rows))
            )
        states = step.sampled_states
        # A request with drafts samples every verified position: row j is its output
        # position num_output_tokens + j (docs/architecture.md §11).
        row_states = [s for s, n in zip(states, num_rows) for _ in range(n)]
        offsets = [j for n in num_rows for j in range(n)]
        metadata = self._sampling_metadata(row_states, offsets)
        result = self.sampler(logits, metadata)
        self.parallel.broadcast(result.sampled_token_ids)
        token_ids, last = verify_drafts(result.sampled_token_ids, num_rows, step.drafts)
        logprobs = result.logprobs
        if logprobs is not None and len(row_states) > len(states):
            # Requests with logprobs never draft: their one row is their first.
            first = self.buffers.to_device(np.asarray(first_rows, dtype=np.int64))
            logprobs = LogprobsTensors(
                logprobs.token_ids[first], logprobs.logprobs[first], logprobs.ranks[first]
            )
        positions = [state.num_output_tokens for state in states]
        for state, drafts in zip(states, step.drafts):
            state.num_output_tokens += 1
            state.verified_drafts |= bool(drafts)
        sampled = _SampledTokens(
            step.sampled_req_ids, states, positions, token_ids, logprobs, self.copy_stream,
            step.drafts,
        )
        if not self.pipelined:
            newest = None
            if step.draft_bases is not None:
                newest = step.draft_bases + (token_ids != NO_TOKEN).sum(dim=1)
            self._feed_back(step, last, newest)
            self._unsettled.append(sampled)
        output = _AsyncOutput(step.req_ids, step.sampled_req_ids, sampled, step.prompt_logprobs)
        return output if self.async_scheduling else output.get_output()

    def _settle_verified(self, states: list[CachedRequestState]) -> None:
        """Waits for the host copy of any earlier verification of `states`: a request's
        output position (seeds, `min_tokens`, where its tokens land) counts the drafts it
        kept. On CUDA the forward is queued by then, so the device does not idle."""
        ids = {id(state) for state in states}
        if any(sampled.verified & ids for sampled in self._unsettled):
            self._settle(block=True)

    def _feed_back(
        self, step: _Step, token_ids: torch.Tensor, newest: torch.Tensor | None = None
    ) -> None:
        """Writes a step's sampled ids into `last_token` at the requests' current rows, and
        `newest` (the position of each request's newest kept token, after a verification
        with drafts) into `next_start`.

        Rows are looked up now, not at execute time: a newer step executed in between may
        have moved a row (the last row fills a hole) or dropped a request that finished or
        was preempted. A dropped request needs no feedback; its token still reaches the
        engine, which keeps it (preempted) or drops it (finished).
        """
        batch = self.input_batch
        rows: list[int] = []
        keep: list[int] = []
        for i, (req_id, state) in enumerate(zip(step.sampled_req_ids, step.sampled_states)):
            row = batch.req_id_to_index.get(req_id)
            if row is not None and batch.states[row] is state:
                rows.append(row)
                keep.append(i)
        if not rows:
            return
        if len(keep) < len(step.sampled_req_ids):
            kept = self.buffers.to_device(np.asarray(keep, dtype=np.int64))
            token_ids = token_ids[kept]
            newest = newest[kept] if newest is not None else None
        rows_dev = self.buffers.to_device(np.asarray(rows, dtype=np.int64))
        self.last_token.index_copy_(0, rows_dev, token_ids)
        if newest is not None:
            self.next_start.index_copy_(0, rows_dev, newest)

    def _unsettled_tokens(
        self, states: list[CachedRequestState]
    ) -> tuple[list[torch.Tensor], list[list[int]]]:
        """The device tensors of the steps whose host copy has not been settled into
        `output_token_ids` yet (async scheduling), and per state the indices of its tokens in
        their concatenation, oldest first."""
        self._settle(block=False)
        row_of = {id(state): i for i, state in enumerate(states)}
        picks: list[list[int]] = [[] for _ in states]
        parts: list[torch.Tensor] = []
        offset = 0
        for sampled in self._unsettled:
            for j, (state, position) in enumerate(zip(sampled.states, sampled.positions)):
                i = row_of.get(id(state))
                # A resumed request may hold the token already (position below its length).
                if i is not None and position >= len(state.output_token_ids):
                    picks[i].append(offset + j)
            parts.append(sampled.device_token_ids.reshape(-1).to(torch.int64))
            offset += len(sampled.states)
        return parts, picks

    def _pending_output_ids(self, states: list[CachedRequestState]) -> torch.Tensor | None:
        """[len(states), P] int64 on the device, padded with vocab_size: per state, the
        tokens it sampled in steps whose host copy has not been settled yet. None when there
        are none."""
        parts, picks = self._unsettled_tokens(states)
        width = max((len(p) for p in picks), default=0)
        if width == 0:
            return None
        offset = sum(part.numel() for part in parts)
        # The last element is the padding id, gathered wherever a row has fewer tokens.
        parts.append(torch.full((1,), self.vocab_size, dtype=torch.int64, device=self.device))
        index = np.full((len(states), width), offset, dtype=np.int64)
        for i, p in enumerate(picks):
            index[i, : len(p)] = p
        return torch.cat(parts)[self.buffers.to_device(index)]

    def _recent_output_ids(self, states: list[CachedRequestState], width: int) -> torch.Tensor:
        """[len(states), width] int64 on the device: each state's newest `width` output
        tokens, right-aligned, -1 before its first. Tokens still on the device are gathered
        there (never a wait)."""
        parts, picks = self._unsettled_tokens(states)
        offset = sum(part.numel() for part in parts)
        host: list[int] = []
        index = np.full((len(states), width), -1, dtype=np.int64)
        for i, state in enumerate(states):
            if not state.sampling_params.has_history_bans:
                continue  # its row stays all -1: no prefix to match
            tail = state.output_token_ids[-width:]
            base = offset + len(host)
            host += tail
            seq = [base + k for k in range(len(tail))] + picks[i]
            seq = seq[-width:]
            if seq:
                index[i, width - len(seq):] = seq
        pad = len(host) + offset
        index[index < 0] = pad
        parts.append(self.buffers.to_device(np.asarray(host + [-1], dtype=np.int64)))
        return torch.cat(parts)[self.buffers.to_device(index)]

    def _sampling_metadata(
        self, states: list[CachedRequestState], offsets: list[int] | None = None
    ) -> SamplingMetadata:
        """Sampling inputs for one row per state; row i samples output position
        num_output_tokens + offsets[i] (0 without drafts)."""
        offsets = offsets or [0] * len(states)
        params = [s.sampling_params for s in states]
        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)

        # The engine core admits only values these dtypes hold (validation.check_runner_inputs): a
        # conversion error here would fail every request of the step.
        def column(name: str, off=None, dtype=SAMPLING_FLOAT_DTYPE) -> torch.Tensor | None:
            """Per-row values of one parameter on the device; None when every row has `off`."""
            values = [getattr(p, name) for p in params]
            if off is not None and all(v == off for v in values):
                return None
            return self.buffers.to_device(np.asarray(values, dtype=dtype))

        no_penalties = not any(p.has_penalties for p in params)
        prompt_ids = None
        output_ids: list[list[int]] = []
        pending_ids = None
        if not no_penalties:
            # Tokens whose host copy has not arrived come from the device (never a wait).
            pending_ids = self._pending_output_ids(states)
            width = max(len(s.prompt_token_ids) for s in states)
            padded = np.full((len(states), width), self.vocab_size, dtype=np.int64)
            for i, s in enumerate(states):
                padded[i, : len(s.prompt_token_ids)] = s.prompt_token_ids
            prompt_ids = self.buffers.to_device(padded)
            output_ids = [list(s.output_token_ids) for s in states]
        output_positions = [s.num_output_tokens + off for s, off in zip(states, offsets)]
        min_tokens = {
            i: (p.min_tokens, set(p.all_stop_token_ids))
            for i, (p, position) in enumerate(zip(params, output_positions))
            if position < p.min_tokens and p.all_stop_token_ids
        }
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        recent = None
        bad_words = {i: p.bad_words_token_ids for i, p in enumerate(params) if p.bad_words_token_ids}
        if any(p.has_history_bans for p in params):
            width = max(len(q) for seqs in bad_words.values() for q in seqs) - 1
            recent = self._recent_output_ids(states, width)
        return SamplingMetadata(
            temperature=None if all_greedy else column("temperature"),
            all_greedy=all_greedy,
            all_random=not any(greedy),
            top_p=column("top_p", 1.0),
            top_k=column("top_k", 0, TOP_K_DTYPE),
            min_p=column("min_p", 0.0),
            seeds=[p.seed for p in params],
            output_positions=output_positions,
            generator=self.generator,
            no_penalties=no_penalties,
            presence_penalties=None if no_penalties else column("presence_penalty"),
            frequency_penalties=None if no_penalties else column("frequency_penalty"),
            repetition_penalties=None if no_penalties else column("repetition_penalty"),
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            pending_output_token_ids=pending_ids,
            min_tokens=min_tokens,
            max_num_logprobs=max(logprobs) if logprobs else None,
            allowed_token_ids={
                i: p.allowed_token_ids for i, p in enumerate(params) if p.allowed_token_ids
            },
            logit_bias={
                i: (list(p.logit_bias), [float(v) for v in p.logit_bias.values()])
                for i, p in enumerate(params)
                if p.logit_bias
            },
            bad_words=bad_words,
            recent_output_token_ids=recent,
        )
