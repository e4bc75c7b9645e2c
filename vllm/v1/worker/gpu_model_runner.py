"""The model runner: builds flat varlen inputs from a SchedulerOutput, runs the model, samples.

`execute_model` runs the forward pass and keeps the logits of the rows that sample this step;
`sample_tokens` applies the grammar bitmask (if any) and samples. Between the two, the engine
computes the bitmask on the CPU while the forward runs. Several steps may be executed before
the oldest is sampled (a deferred structured-output step, docs/architecture.md §4): the runner
keeps them first in, first out, and each sample_tokens call samples the oldest.

A step reads as prepare (host arrays, `input_prep.prepare`) -> stage (device copies, completed
by DeviceFeedback) -> run the model -> compute logits. Sampled ids stay on the device and are
fed into the next step's inputs there (`device_feedback.py`), so building a step never waits
for the previous one (this is what makes async scheduling possible). A step must not feed a
request whose previous step is executed but not sampled yet: the scheduler never schedules
one (AsyncScheduler).

With pipeline stages (docs/architecture.md §10) each rank runs its stage's layers: a stage
other than the first receives the hidden states and residual of the previous one, a stage
other than the last sends its own to the next, and only the last stage computes logits and
samples. The first stage never sees a sample, so there every rank learns a request's tokens
from the scheduler output instead (the scheduler never runs a request in two in-flight
steps under pipeline parallelism). With tensor parallelism every rank of the last stage
samples the same gathered logits; rank 0's tokens are broadcast so the ranks cannot drift.
"""

from __future__ import annotations

import inspect
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.attention.backends.abstract import AttentionMetadata
from vllm.attention.kv_cache_dtype import check_fp8_cache_device, is_fp8, kv_cache_torch_dtype
from vllm.config import VllmConfig
from vllm.distributed.parallel_state import ParallelContext
from vllm.model_executor.layers import batch_invariant_linear
from vllm.model_executor.layers.column_major import make_column_major
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.sample.sampler import LogprobsTensors, Sampler
from vllm.v1.spec_decode.eagle3_proposer import Eagle3Proposer
from vllm.v1.spec_decode.verify import NO_TOKEN, verify_drafts, with_fast_forward
from vllm.v1.worker.cuda_graph import DecodeGraphs, capture_decode_graphs
from vllm.v1.worker.device_feedback import DeviceFeedback
from vllm.v1.worker.executed_step import ExecutedStep
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from vllm.v1.worker.grammar_bitmask import apply_grammar_bitmask, grammar_mask
from vllm.v1.worker.input_buffers import InputBuffers
from vllm.v1.worker.input_prep import StepInputs, prepare
from vllm.v1.worker.logits_buffers import LogitsBuffers
from vllm.v1.worker.kv_cache_memory import kv_block_bytes, zeroed
from vllm.v1.worker.post_layer import PostLayer, sampler_graphs_enabled
from vllm.v1.worker.prompt_logprobs import compute_prompt_logprobs
from vllm.v1.worker.request_slots import table_bytes
from vllm.v1.worker.sampled_tokens import AsyncOutput, SampledTokens
from vllm.v1.worker.sampling_inputs import SamplingInputs

if TYPE_CHECKING:
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.v1.worker.mm_step import MultiModalInputs

logger = logging.getLogger(__name__)

# CPU GEMMs give row results that depend on the row count below some count (MKL on AVX-512:
# 12); padding every matmul to at least this many rows makes a request's numbers independent
# of its batch, which async = sync equivalence relies on. Models whose every matrix has a
# row plan pad to what the plans ask instead, often nothing (layers/batch_invariant_linear.py).
_CPU_MIN_ROWS = 16


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
        # What the paged KV cache stores (--kv-cache-dtype): the model's dtype or FP8.
        self.kv_cache_dtype = kv_cache_torch_dtype(
            vllm_config.cache_config.cache_dtype, self.dtype
        )
        self.block_size = vllm_config.cache_config.block_size
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.async_scheduling = vllm_config.scheduler_config.async_scheduling
        # Speculative decoding: some steps verify drafts.
        self.speculative = vllm_config.speculative_config is not None
        self.vocab_size = mc.vocab_size
        self.min_rows = _CPU_MIN_ROWS if self.device.type == "cpu" else 1
        # Rows the LM head's product is padded to (load_model: the head's own plan, where
        # it has one, else min_rows).
        self.logits_min_rows = self.min_rows
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()
        self.input_batch = InputBatch(self.max_num_reqs, mc.max_model_len, self.block_size)
        self.requests: dict[str, CachedRequestState] = {}
        # On the host on every device: the post-layer graphs read the keys it draws from the
        # step's one upload (post_layer.py), and the eager path draws the same ones.
        generator = torch.Generator()
        generator.manual_seed(mc.seed)
        self.copy_stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        self._unsettled: deque[SampledTokens] = deque()
        # Executed steps not sampled yet, oldest first (see module docstring).
        self._steps: deque[ExecutedStep] = deque()
        sched = vllm_config.scheduler_config
        self.buffers = InputBuffers(
            max(sched.max_num_batched_tokens, self.max_num_reqs, self.min_rows),
            self.max_num_reqs,
            self.input_batch.max_num_blocks,
            self.device,
        )
        # Sampled tokens and kept-draft positions fed back into inputs on the device.
        self.feedback = DeviceFeedback(
            self.max_num_reqs, self.block_size, self.buffers, self.speculative
        )
        self.sampling_inputs = SamplingInputs(
            self.buffers.to_device, generator, self.vocab_size, self.device, self._in_flight
        )
        self.graphs: DecodeGraphs | None = None
        # LM head + sampling of decode steps from fixed buffers, in CUDA graphs (post_layer.py).
        self.post_layer: PostLayer | None = None
        # Reused logits memory (CPU models whose compute_logits takes `out`; see load_model).
        self.logits_buffers: LogitsBuffers | None = None
        # LoRA slots of the model's layers (None: LoRA is off).
        self.lora: LoRAModelManager | None = None
        # The EAGLE-3 head that drafts after each sampled step (None: another method).
        self.eagle3: Eagle3Proposer | None = None
        # Image embeddings and M-RoPE positions (a vision-language model; else None).
        self.mm: MultiModalInputs | None = None
        # Called on this thread as each forward pass starts, its inputs ready: the uni
        # executor hands the previous step's samples to the engine thread then.
        self.on_forward_start: Callable[[], None] | None = None

    # ------------------------------------------------------------------ setup

    def load_model(self) -> None:
        """Builds the model and loads its weights onto the device."""
        from vllm.model_executor.model_loader.loader import get_model

        self.model = get_model(self.config.model_config, self.parallel)
        if getattr(self.model, "is_multimodal", False):
            from vllm.v1.worker.mm_step import MultiModalInputs

            size = self.config.multimodal_config.encoder_cache_size
            if size is None:
                size = self.config.scheduler_config.max_num_batched_tokens
            self.mm = MultiModalInputs(self.model, size, self.buffers.to_device)
        if self.device.type == "cpu":
            covered = make_column_major(self.model)
            # Each planned product rounds a row alike for any row count from its min_rows on
            # (layers/batch_invariant_linear.py); adapters add row-major products of their own and keep
            # the larger padding, as does a model with matrices left unplanned.
            planned = batch_invariant_linear.plan_model(self.model)
            if covered and self.config.lora_config is None:
                self.min_rows = planned
            head = getattr(self.model, "lm_head", None)
            head_plan = getattr(head, "row_plan", None)
            # The widest product, the one a batch of one would pay most to pad: often it
            # needs no padding at all.
            self.logits_min_rows = (head_plan.min_rows if head_plan is not None
                                    else self.min_rows)
            logger.debug("CPU row padding: %d (body), %d (LM head)", self.min_rows,
                         self.logits_min_rows)
        if is_fp8(self.kv_cache_dtype):
            check_fp8_cache_device(self.device, self.model.attn_backend_cls.fp8_min_capability)
            if self.parallel.layout.rank == 0:
                source = ("the checkpoint's k_scale/v_scale"
                          if getattr(self.model, "kv_scales_from_checkpoint", False)
                          else "1.0 (the checkpoint has no k_scale/v_scale)")
                logger.info("FP8 (e4m3) KV cache; per-layer scales: %s", source)
        takes_out = "out" in inspect.signature(self.model.compute_logits).parameters
        if self.device.type == "cpu" and takes_out and self.parallel.layout.tp_size == 1:
            self.logits_buffers = LogitsBuffers(self.vocab_size)
        spec = self.config.speculative_config
        if spec is not None and spec.method == "eagle3":
            self.eagle3 = Eagle3Proposer(self.config, self.model, self.buffers.max_num_tokens)
        if self.config.lora_config is not None:
            from vllm.lora.model_manager import LoRAModelManager

            self.lora = LoRAModelManager(
                self.model, self.config.lora_config, self.device, self.dtype, self.min_rows,
                self.buffers.to_device,
            )

    def kv_cache_block_bytes(self) -> int:
        """Bytes one KV block takes across all layers, in the cache's dtype (an FP8 cache's
        blocks are half those of a 16-bit one, a quarter of float32's)."""
        assert self.model is not None
        head = self.eagle3.block_bytes() if self.eagle3 is not None else 0
        return head + kv_block_bytes(
            self.model.num_layers, self.block_size, self.model.num_kv_heads,
            self.model.head_dim, self.kv_cache_dtype,
        )

    def _captures_graphs(self) -> bool:
        """Whether decode steps will replay CUDA graphs."""
        return (self.device.type == "cuda" and not self.config.model_config.enforce_eager
                and self.parallel.layout.world_size == 1
                and self.model.attn_backend_cls.supports_cuda_graphs
                and getattr(self.model, "supports_cuda_graphs", True)
                # Each step's adapter rows are host-built index lists a graph cannot replay.
                and self.lora is None)

    def reserved_bytes(self) -> int:
        """Device bytes allocated after the KV cache (the post-layer function's request
        tables), which the cache's sizing must leave free."""
        post = self._captures_graphs() and self.eagle3 is None and sampler_graphs_enabled()
        return table_bytes(self.max_num_reqs, self.vocab_size, penalties=True) if post else 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocates the paged KV cache (zeroed: padded attention reads must not see NaNs)."""
        assert self.model is not None
        shape = self.model.attn_backend_cls.kv_cache_shape(
            num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim
        )
        self.kv_caches = [
            zeroed(shape, self.kv_cache_dtype, self.device) for _ in range(self.model.num_layers)
        ]
        if self.eagle3 is not None:
            self.eagle3.init_cache(num_blocks, zeroed)
        if self._captures_graphs():
            self.graphs = capture_decode_graphs(
                self.model, self.buffers, self.kv_caches, self.max_num_reqs,
                self.config.model_config.max_model_len,
            )
        if self.graphs is not None and self.eagle3 is None and sampler_graphs_enabled():
            self.post_layer = PostLayer(
                self.model.compute_logits, self.model.hidden_size, self.dtype, self.vocab_size,
                self.max_num_reqs, self.device, self.sampling_inputs.generator,
                history=self.sampling_inputs.penalty_history, to_device=self.buffers.to_device,
            )
            self.post_layer.capture()

    # ------------------------------------------------------------------ state

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        # Sorted: a set of ids iterates in a per-process order, and every rank of a parallel
        # engine must move its rows identically (the ranks exchange tensors row by row).
        for req_id in sorted(scheduler_output.finished_req_ids):
            self.requests.pop(req_id, None)
            self._remove_row(req_id)
        if self.eagle3 is not None:
            self.eagle3.forget(scheduler_output.finished_req_ids)
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
                mm_features=new.mm_features,
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
                    # Pipeline stages: no step of this request is in flight (it runs in one
                    # batch at a time), so these are all its outputs, the drafts its last
                    # verification kept included; its seeds' positions count them.
                    state.num_output_tokens = len(state.output_token_ids)

    def _remove_row(self, req_id: str) -> None:
        moved = self.input_batch.remove(req_id)
        if moved is not None:
            self.feedback.move_row(*moved)

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
        if self.mm is not None:
            self.mm.update(scheduler_output)  # pins of finished and preempted requests
        if scheduler_output.total_num_scheduled_tokens == 0:
            self._steps.append(ExecutedStep([], [], [], [], None))
            return None
        inputs = prepare(
            self.input_batch, scheduler_output, self.block_size, self.graphs, self.min_rows
        )
        dev = self._stage(inputs)
        if self.eagle3 is not None:
            self.eagle3.fill_drafts(inputs, scheduler_output.worker_drafts, dev["input_ids"])
        failed = self._set_loras(inputs)
        if self.on_forward_start is not None:
            self.on_forward_start()
        hidden = self._run_model(inputs, dev)
        self.input_batch.num_computed_tokens[inputs.rows_np] = inputs.seq_lens[: inputs.num_reqs]
        if not self.last_stage:
            self.parallel.send_next(torch.stack(hidden))
        step = self._compute_logits(scheduler_output, inputs, dev, hidden)
        step.failed = failed
        if self.eagle3 is not None and self.last_stage:
            self.eagle3.capture(step, inputs, dev, self.input_batch)
        self._steps.append(step)
        self._settle(block=False)
        return None

    def _stage(self, inputs: StepInputs) -> dict[str, torch.Tensor]:
        """Copies a step's host arrays to the device and completes them there: inputs of
        requests verified with drafts are placed after the tokens they kept, and input ids
        the host does not know come from the previous samples (DeviceFeedback). Raises
        RuntimeError when a pipeline stage lacks an input id (the scheduler sends each)."""
        verified = self.feedback.take_verified(self.input_batch, inputs.rows)
        dev = self.buffers.stage(inputs.arrays())
        if verified:
            reads_host = self.model.attn_backend_cls.reads_host_lengths
            self.feedback.place_after_kept(dev, verified, inputs, reads_host)
        unknown = int((~inputs.known).sum())
        if unknown and self.pipelined:
            # The scheduler sends every token before a request runs again (module docstring).
            raise RuntimeError(
                f"pipeline stage {self.parallel.layout.pp_rank}: {unknown} input tokens "
                "were never sent by the scheduler"
            )
        self.feedback.fill_unknown(dev["input_ids"], inputs)
        return dev

    def _set_loras(self, inputs: StepInputs) -> dict[str, str]:
        """Gives the step's token rows their requests' adapters; returns the requests whose
        adapter failed to load (request id -> why): they run on the base model this step and
        the engine core ends them with that error."""
        if self.lora is None:
            return {}
        states = [self.input_batch.states[r] for r in inputs.rows]
        failed = self.lora.set_batch(
            [state.lora_request for state in states], inputs.num_sched, inputs.padded_tokens
        )
        return {state.req_id: failed[state.lora_request.lora_int_id] for state in states
                if state.lora_request is not None and state.lora_request.lora_int_id in failed}

    def _run_model(
        self, inputs: StepInputs, dev: dict[str, torch.Tensor]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The forward pass over staged inputs: a graph replay for a decode batch a graph
        holds, else eager. Receives the previous stage's (hidden, residual) first when this
        is not the first stage; returns the hidden states (or this stage's pair)."""
        assert self.model is not None
        intermediate = None
        if not self.first_stage:
            # One message per step: (hidden, residual) stacked.
            shape = (2, inputs.padded_tokens, self.model.hidden_size)
            received = self.parallel.recv_prev(shape, self.dtype, self.device)
            intermediate = (received[0], received[1])
        if inputs.graph_size is not None:
            return self.graphs.replay(inputs.graph_size)
        metadata = AttentionMetadata(
            num_actual_tokens=inputs.num_tokens,
            num_reqs=inputs.num_reqs,
            max_query_len=int(inputs.num_sched.max()),
            max_seq_len=int(inputs.seq_lens.max()),
            query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"],
            block_table=dev["block_table"],
            slot_mapping=dev["slot_mapping"],
            query_start_loc_cpu=torch.from_numpy(inputs.cu),
            seq_lens_cpu=torch.from_numpy(inputs.seq_lens),
        )
        mm = ({} if self.mm is None
              else self.mm.build(self.input_batch, inputs, dev["positions"]))
        return self.model(
            dev["input_ids"], dev["positions"], self.kv_caches, metadata, intermediate, **mm
        )

    def _compute_logits(
        self,
        scheduler_output: SchedulerOutput,
        inputs: StepInputs,
        dev: dict[str, torch.Tensor],
        hidden: torch.Tensor,
    ) -> ExecutedStep:
        """What sample_tokens needs of this step: on the last stage, the logits of each
        sampling request's last position and of its drafts' positions, and prompt logprobs."""
        req_ids, drafts = inputs.req_ids, inputs.drafts
        sampled = set(scheduler_output.sampled_req_ids)
        pick = [i for i, r in enumerate(req_ids) if r in sampled]
        step = ExecutedStep(
            req_ids=req_ids,
            sampled_req_ids=[req_ids[i] for i in pick],
            sampled_states=[self.input_batch.states[inputs.rows[i]] for i in pick],
            drafts=[drafts[i] if drafts is not None else [] for i in pick],
            logits=None,
        )
        skip = scheduler_output.num_fast_forward_tokens
        step.skipped = [skip.get(req_ids[i], 0) for i in pick]
        if not self.last_stage:
            return step
        decode = len(pick) == inputs.num_reqs == inputs.num_tokens and not any(step.drafts)
        if pick and decode and self.post_layer is not None:
            step.hidden_rows = self.post_layer.gather(hidden, inputs.cu[1:][pick],
                                                      self.buffers.to_device)
        elif pick:
            # The last position of each sampling request, and the ones of its drafts before it
            # (fast-forward tokens aside: the positions before them sample nothing).
            ends = inputs.cu[1:][pick]
            counts = np.asarray(step.num_sampled_rows, dtype=np.int64)
            num_rows = int(counts.sum())
            idx = np.zeros(max(num_rows, self.logits_min_rows), dtype=np.int64)
            idx[:num_rows] = np.repeat(ends - counts, counts) + (
                np.arange(num_rows) - np.repeat(np.cumsum(counts) - counts, counts)
            )
            rows = hidden[self.buffers.to_device(idx)]
            if self.logits_buffers is not None:
                step.logits_buffer = self.logits_buffers.take(len(idx))
                step.logits = self.model.compute_logits(rows, out=step.logits_buffer)
            else:
                step.logits = self.model.compute_logits(rows)
            step.logits = step.logits[:num_rows]
            if any(step.drafts):
                # Read from the device: this forward's own positions may have been placed there.
                bases = ends - np.asarray(step.num_rows, dtype=np.int64)
                step.draft_bases = dev["positions"][self.buffers.to_device(bases)]
        step.prompt_logprobs = compute_prompt_logprobs(
            self.model.compute_logits, self.buffers.to_device, self.vocab_size,
            self.input_batch, inputs, hidden,
        )
        return step

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
        if step.logits is None and step.hidden_rows is None:
            if step.head is not None:  # prompt chunks only: the head's cache follows them
                self.eagle3.propose(step.head, None, [], [])
            out = ModelRunnerOutput(
                req_ids=step.req_ids,
                sampled_token_ids=[[] for _ in step.req_ids],
                prompt_logprobs=step.prompt_logprobs,
                failed=step.failed or None,
            )
            return out if step.req_ids else EMPTY_MODEL_RUNNER_OUTPUT
        num_rows = step.num_sampled_rows
        self._settle_verified(step.sampled_states)
        first_rows = np.cumsum([0] + num_rows[:-1]).tolist()
        states = step.sampled_states
        # A request with drafts samples every verified position: row j is its output
        # position num_output_tokens + skipped + j (docs/architecture.md §11).
        row_states = [s for s, n in zip(states, num_rows) for _ in range(n)]
        offsets = [k + j for n, k in zip(num_rows, step.skipped) for j in range(n)]
        result = None
        if step.hidden_rows is not None:  # None back: a request needs the eager path
            result = self.post_layer.sample(step.hidden_rows, states, grammar_output,
                                            step.sampled_req_ids)
            if result is None:
                step.logits = self.model.compute_logits(step.hidden_rows)[: len(states)]
        logits = step.logits
        metadata = self.sampling_inputs.build(row_states, offsets) if result is None else None
        if grammar_output is not None and result is None:
            to_row = dict(zip(step.sampled_req_ids, first_rows))
            on_cpu = logits.device.type == "cpu" and logits.dtype == torch.float32
            if on_cpu and logits.is_contiguous():
                # The sampler reads the mask in its argmax pass (or applies it itself).
                metadata.grammar_mask = grammar_mask(grammar_output, to_row, *logits.shape)
            else:
                apply_grammar_bitmask(logits, grammar_output, to_row)
        try:
            result = result or self.sampler(logits, metadata)
        finally:
            del logits
            step.logits = None
            if step.logits_buffer is not None:
                # Nothing reads the logits after sampling: the sampler's outputs are copies.
                self.logits_buffers.give(step.logits_buffer)
        self.parallel.broadcast(result.sampled_token_ids)
        samples = with_fast_forward(result.sampled_token_ids, step.drafts, step.skipped)
        token_ids, last = verify_drafts(samples, step.num_rows, step.drafts, step.guesses)
        proposals = None
        if step.head is not None:
            proposals = self.eagle3.propose(
                step.head, token_ids, step.num_rows, step.sampled_req_ids,
                self.eagle3.chain_length(grammar_output is not None))
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
        sampled = SampledTokens(
            step.sampled_req_ids, states, positions, token_ids, logprobs, self.copy_stream,
            step.drafts, proposals,
        )
        if not self.pipelined:
            newest = None
            if step.draft_bases is not None:
                newest = step.draft_bases + (token_ids != NO_TOKEN).sum(dim=1)
            self.feedback.write(
                self.input_batch, step.sampled_req_ids, step.sampled_states, last, newest
            )
            self._unsettled.append(sampled)
        output = AsyncOutput(step.req_ids, step.sampled_req_ids, sampled, step.prompt_logprobs,
                             step.failed or None)
        return output if self.async_scheduling else output.get_output()

    def _settle_verified(self, states: list[CachedRequestState]) -> None:
        """Waits for the host copy of any earlier verification of `states`: a request's
        output position (seeds, `min_tokens`, where its tokens land) counts the drafts it
        kept. On CUDA the forward is queued by then, so the device does not idle."""
        ids = {id(state) for state in states}
        if any(sampled.verified & ids for sampled in self._unsettled):
            self._settle(block=True)

    def _in_flight(self) -> deque[SampledTokens]:
        """The sampled steps whose host copy has not been settled, oldest first, after
        settling those that have landed (never waits)."""
        self._settle(block=False)
        return self._unsettled
