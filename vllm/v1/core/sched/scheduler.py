"""The synchronous scheduler: one token budget per step shared by decodes and chunked prefills."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from vllm.config import VllmConfig
from vllm.exceptions import ErrorKind, InvalidRequestError
from vllm.reasoning.budget import ThinkingBudget
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.drafting import Drafter
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.core.sched.postprocess import (
    append_output_tokens,
    can_sample_more,
    error_output,
    find_cache_hit,
    keep_prompt_logprobs,
    make_grammar_output,
    make_request_output,
    num_new_tokens,
    take_first_scheduled_time,
)
from vllm.v1.core.sched.request_queue import WaitingQueue, add_running, make_waiting_queue
from vllm.v1.core.sched.step_builder import StepBuilder
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.metrics.engine_stats import EngineCoreStats, GrammarStats
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.spec_decode.proposer import Proposer
from vllm.v1.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides, each step, which requests compute how many tokens, within one token budget
    (`max_num_batched_tokens`); schedule() takes, in this order:

    1. Running requests, in the running list's order (oldest admission first; under
       --scheduling-policy priority, by priority then arrival): each computes every token it
       has not computed (its next token when decoding; tokens in flight count as known), or
       as many as the budget leaves (a chunk of its prefill). Skipped: a request whose every
       allowed token is already sampled or in flight (max_tokens, max_model_len), and one
       whose next input is sampled in a step not yet issued (AsyncScheduler). When KV blocks
       run out, the last running request is preempted (freed, recomputed later): the most
       recently admitted one, or the lowest-priority one.
    2. Waiting requests in the queue's order (first come first served, or by priority then
       arrival; request_queue.py), unless step 1 preempted, while the budget,
       `max_num_seqs` and KV blocks allow: each computes its prompt (all its known tokens,
       once preempted) past its prefix-cache hit, or as much as the budget leaves. A request
       whose grammar still compiles, whose adapter would exceed `max_loras`, or whose
       preemption left samples in flight stays queued without blocking those behind it; the
       first one whose blocks do not fit stops admission.
    3. Drafts (speculative decoding), for running requests scheduled for exactly their next
       token, from the budget and blocks the first two steps left.

    Images: a step encodes at most `max_num_batched_tokens` placeholder tokens' worth of
    images (one larger image alone), as upstream budgets encoder work; a request's tokens
    stop before an image that does not fit (StepBuilder.fit_images), and one that cannot
    start yet stops admission like blocks that do not fit.

    With pipeline stages a step holds only its share of the requests (_max_batch_requests).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_manager: KVCacheManager,
        structured_output_manager: StructuredOutputManager | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """`proposer` drafts for speculative decoding (None: no drafts); the engine builds it
        from `vllm_config` (build_proposer) before it sizes the KV cache."""
        self.config = vllm_config
        sched = vllm_config.scheduler_config
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.max_model_len = sched.max_model_len
        lora_config = vllm_config.lora_config
        # Most distinct LoRA adapters among the running requests (0: LoRA is off).
        self.max_loras = lora_config.max_loras if lora_config is not None else 0
        # Pipeline stages: batches in flight at once hold different requests (see schedule).
        self.pipeline_stages = vllm_config.parallel_config.pipeline_parallel_size
        self.compile_timeout_s = vllm_config.structured_outputs_config.compile_timeout_s
        self.kv_cache_manager = kv_cache_manager
        self.structured_output_manager = structured_output_manager
        self.requests: dict[str, Request] = {}
        # Scheduling policy: the waiting queue's order and the running list's (request_queue).
        self.policy = sched.policy
        self.waiting: WaitingQueue = make_waiting_queue(self.policy)
        self.running: list[Request] = []
        # Finished since the last schedule(): the runner must drop them.
        self.finished_req_ids: set[str] = set()
        # Preempted in a step that never ran (see unschedule): sent with the next step.
        self._unsent_preempted_ids: set[str] = set()
        # Block counts of requests trimmed after a verification, for the next step.
        self._kept_blocks: dict[str, int] = {}
        # Outputs for requests that ended outside update_from_output (compile errors).
        self._pending_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        # Aborts that found the request still live (cumulative), for the stats record.
        self.num_aborted_requests = 0
        self._step_id = 0
        # step_id -> the requests a step scheduled, until its output is handled: an id of a
        # request that ended meanwhile may belong to a new request by then.
        self._step_requests: dict[int, dict[str, Request]] = {}
        # Drafts for speculative decoding, and the counters of their verifications.
        manager = structured_output_manager
        self.drafter = Drafter(proposer, self.max_model_len, manager and manager.fast_forward)

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queues a request; starts compiling its grammar in the background if it has one.

        Raises ValueError when the id is already live, and whatever starting the compile
        raised; either way nothing of the request stays registered.
        """
        if request.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        budget = request.sampling_params.thinking_token_budget
        if budget is not None:
            parser = (self.structured_output_manager.reasoning_parser
                      if self.structured_output_manager is not None else None)
            if parser is None:
                raise InvalidRequestError("thinking_token_budget", "needs a reasoning parser")
            request.thinking_budget = ThinkingBudget.start(parser, budget,
                                                           request.prompt_token_ids)
        if request.use_structured_output:
            assert self.structured_output_manager is not None
            try:
                self.structured_output_manager.grammar_init(request)
            except BaseException:
                self.structured_output_manager.clear(request)
                raise
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_with_error(self, request_id: str, message: str, kind: ErrorKind) -> None:
        """Ends a request with finish reason "error", `message` and `kind`, freeing everything
        it holds.

        An id the scheduler does not hold (a request that was never admitted) still gets its
        error output, so whoever sent it learns why. The output goes out with the next step.
        """
        request = self.requests.get(request_id)
        if request is None:
            logger.warning("request %s rejected: %s", request_id, message)
        else:
            logger.warning("request %s failed: %s", request_id, message)
            request.status = RequestStatus.FINISHED_ERROR
            request.error_message = message
            request.error_kind = kind
            self._dequeue(request)
            self._free_request(request)
        out = error_output(request_id, message, kind)
        if request is not None:
            out.first_scheduled_time = take_first_scheduled_time(request)
        self._pending_outputs.append(out)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Ends the given requests (e.g. aborts) and frees their blocks and grammars.

        Unknown or already finished ids are ignored.
        """
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if status == RequestStatus.FINISHED_ABORTED:
                self.num_aborted_requests += 1
            self._dequeue(request)
            request.status = status
            self._free_request(request)

    def _dequeue(self, request: Request) -> None:
        """Takes a request out of the running list or the waiting queue, wherever it is."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request.request_id)
        self.drafter.release(request.request_id)
        if request.use_structured_output and self.structured_output_manager is not None:
            self.structured_output_manager.clear(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_requests(self) -> bool:
        """True while there is anything to schedule or report (including finished ids)."""
        return bool(self.has_unfinished_requests() or self.finished_req_ids
                    or self._pending_outputs)

    # ------------------------------------------------------------------ schedule

    def _max_batch_requests(self) -> int:
        """Requests one step may hold. With pipeline stages, a step takes its share of the
        unfinished requests, so that the next steps (scheduled while it is still in the
        pipeline) find requests to run and every stage stays busy."""
        if self.pipeline_stages == 1:
            return self.max_num_seqs
        share = -(-self.get_num_unfinished_requests() // self.pipeline_stages)
        return max(1, min(self.max_num_seqs, share))

    def schedule(self) -> SchedulerOutput:
        """Builds the next step: running requests, then admissions, then drafts (see the
        class). Side effects: allocates KV blocks, may preempt requests, admits waiting
        requests, and advances num_computed_tokens of every scheduled request."""
        step = StepBuilder(self.max_num_batched_tokens, self._max_batch_requests(),
                           encoder_budget=self.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            # Blocks ran short: a new request would take what the running ones need.
            self._schedule_waiting(step)
        self._schedule_drafts(step)
        self._step_id += 1
        output = step.build(self._step_id, self.finished_req_ids, self._unsent_preempted_ids,
                            self._kept_blocks)
        self._kept_blocks = {}
        self.finished_req_ids = set()
        self._unsent_preempted_ids = set()
        self._update_after_schedule(output)
        return output

    def _schedule_running(self, step: StepBuilder) -> None:
        """Step 1: the running requests' next tokens, preempting when blocks run out."""
        i = 0
        while i < len(self.running) and not step.is_full():
            request = self.running[i]
            i += 1
            num_new = self._num_runnable(request, step)
            if num_new <= 0:
                continue
            new_blocks = self._allocate_or_preempt(request, num_new, step)
            if new_blocks is None:
                break  # `request` itself was preempted: nothing else fits either
            # With pipeline stages the workers take tokens from the step, not from their own
            # samples (the first stage never sees a sample).
            step.add_running(request, num_new, new_blocks, self.pipeline_stages > 1)

    def _num_runnable(self, request: Request, step: StepBuilder) -> int:
        """Tokens a running request computes this step within the step's budgets (0: skip
        it)."""
        num_new = step.fit_images(request, request.num_computed_tokens,
                                  min(num_new_tokens(request), step.budget), admitted=False)
        samples = num_new == num_new_tokens(request)
        if (
            num_new <= 0
            or (samples and not can_sample_more(request, self.max_model_len))
            or self._waits_for_sampling(request)
        ):
            return 0
        return num_new

    def _allocate_or_preempt(
        self, request: Request, num_new: int, step: StepBuilder
    ) -> list[int] | None:
        """Blocks for `num_new` more tokens of `request`, preempting the last running requests
        (the newest, or the lowest-priority ones) until they fit; None once `request` itself
        had to go. The running list is scheduled in order, so no victim was scheduled in this
        step before it."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(
                request.request_id, request.num_computed_tokens, num_new,
                request.block_hash_tokens,
            )
            if new_blocks is not None:
                return new_blocks
            victim = self.running.pop()
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is request:
                return None

    def _schedule_waiting(self, step: StepBuilder) -> None:
        """Step 2: admits waiting requests in order; the ones that cannot start yet keep
        their place at the head of the queue."""
        skipped: list[Request] = []
        # Adapters of the running requests: at most max_loras, so every step fits the
        # runner's slots; a request with another adapter waits until one leaves.
        adapters = {
            r.lora_request.lora_int_id for r in self.running if r.lora_request is not None
        }
        while self.waiting and len(self.running) < self.max_num_seqs and not step.is_full():
            request = self.waiting.peek()
            lora = request.lora_request
            if not self._ready_to_admit(request) or (
                lora is not None
                and lora.lora_int_id not in adapters
                and len(adapters) >= self.max_loras
            ):
                # A request whose grammar failed has left the queue already.
                if not request.is_finished():
                    skipped.append(self.waiting.pop())
                continue
            if not self._admit(request, step):
                break
            if lora is not None:
                adapters.add(lora.lora_int_id)
        self.waiting.restore(skipped)

    def _admit(self, request: Request, step: StepBuilder) -> bool:
        """Moves the head of the queue to the running list with the tokens the budgets leave
        it past its prefix-cache hit; False (nothing changed) when its blocks do not fit or
        the step can encode none of its images yet."""
        hit_blocks, num_hit = find_cache_hit(self.kv_cache_manager, request)
        num_new = min(request.num_tokens - num_hit, step.budget)
        num_new = step.fit_images(request, num_hit, num_new, admitted=True)
        if num_new <= 0:
            return False
        new_blocks = self.kv_cache_manager.allocate_slots(
            request.request_id, num_hit, num_new, request.block_hash_tokens, hit_blocks,
            cache_salt=request.block_hash_salt,
        )
        if new_blocks is None:
            return False
        self.waiting.pop()
        request.num_computed_tokens = num_hit
        if request.status != RequestStatus.PREEMPTED:
            request.num_cached_tokens = num_hit
        step.add_admitted(request, num_new, self.kv_cache_manager.get_block_ids(request.request_id))
        request.status = RequestStatus.RUNNING
        add_running(self.running, request, self.policy)
        return True

    def _schedule_drafts(self, step: StepBuilder) -> None:
        """Step 3: drafts last, so they get only the budget and blocks that every regular
        token and admission left and never cost another request its place."""
        if step.budget <= 0:
            return
        candidates = [
            (request, self._assumed_in_flight(request))
            for request in step.decoding() if num_new_tokens(request) == 1
        ]
        self.drafter.schedule(step, candidates, self.kv_cache_manager)

    def unschedule(self, output: SchedulerOutput) -> None:
        """Keeps the runner-facing news of a step that schedules no tokens and is never run:
        its finished and preempted ids go out with the next step instead."""
        assert output.total_num_scheduled_tokens == 0
        self._step_requests.pop(output.step_id, None)
        self.finished_req_ids |= output.finished_req_ids
        self._unsent_preempted_ids |= output.preempted_req_ids
        self._kept_blocks = {**output.num_kept_blocks, **self._kept_blocks}

    def sampling_issued(self, scheduler_output: SchedulerOutput) -> None:
        """Tells the scheduler that the engine has issued `scheduler_output`'s sample_tokens.
        Nothing to do here: a request whose token is not known yet is never scheduled."""

    def _waits_for_sampling(self, request: Request) -> bool:
        """True while `request` must not be scheduled because its next input token is sampled
        in a step whose sample_tokens has not been issued (AsyncScheduler)."""
        return False

    def _assumed_in_flight(self, request: Request) -> list[int]:
        """For a request scheduled now for its next token: the tokens its in-flight step is
        assumed to feed before the one it samples last (its drafts, unless an earlier
        verification refuted what they assumed); [] with nothing in flight (always, here)."""
        return []

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        if output.scheduled_new_reqs:
            now = time.monotonic()
            for new in output.scheduled_new_reqs:
                request = self.requests[new.req_id]
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = now
        scheduled = {}
        for req_id, n in output.num_scheduled_tokens.items():
            request = scheduled[req_id] = self.requests[req_id]
            request.num_computed_tokens += n
        self._step_requests[output.step_id] = scheduled

    def _ready_to_admit(self, request: Request) -> bool:
        """False while a waiting request cannot start yet; finishes it if its grammar failed."""
        if request.status == RequestStatus.WAITING_FOR_FSM:
            structured_req = request.structured_output_request
            assert structured_req is not None
            if not structured_req.poll(self.compile_timeout_s):
                if structured_req.failed:
                    # A constraint that does not compile (or in time) is the client's fault.
                    message = structured_req.error or "grammar failed"
                    self.finish_with_error(request.request_id, message, ErrorKind.GRAMMAR)
                return False
            request.status = RequestStatus.WAITING
        # A preempted request whose sampled tokens are still in flight resumes once they land.
        return request.num_output_placeholders == 0

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.requeue(request)

    # ------------------------------------------------------------------ grammar

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """Bitmasks for the constrained requests that sample this step, or None if there are none.

        Requests that finished since the step was scheduled are left out: their rows stay
        unmasked and their tokens are dropped anyway. So are requests inside their thinking
        block: the step that samples `</think>` was confirmed before this bitmask is made
        (pending_structured_output_tokens defers it), so the token after it is constrained.
        """
        if not scheduler_output.has_structured_output_requests:
            return None
        assert self.structured_output_manager is not None
        return make_grammar_output(self.structured_output_manager, self.requests,
                                   scheduler_output)

    # ------------------------------------------------------------------ outputs

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Appends sampled tokens, advances grammars, applies stop checks, and frees finished
        requests. Returns one output per request that produced a token or finished; tokens for
        requests that already finished or were aborted are dropped."""
        scheduled = self._step_requests.pop(scheduler_output.step_id, {})
        for req_id, why in (model_runner_output.failed or {}).items():
            if req_id in scheduled and self.requests.get(req_id) is scheduled[req_id]:
                self.finish_with_error(req_id, why, ErrorKind.INVALID_REQUEST)
        outputs, self._pending_outputs = self._pending_outputs, []
        logprobs = model_runner_output.logprobs
        prompt_lps = model_runner_output.prompt_logprobs or {}
        for idx, req_id in enumerate(model_runner_output.req_ids):
            request = scheduled.get(req_id)
            if request is not None and self.requests.get(req_id) is not request:
                # Finished or aborted while this step was in flight (its id may have been
                # reused by a new request since).
                request = None
            if req_id in prompt_lps and request is not None:
                keep_prompt_logprobs(request, prompt_lps[req_id])
            token_ids = model_runner_output.sampled_token_ids[idx]
            if not token_ids or request is None:
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            self._release_placeholders(request, 1 + len(drafts or ()))
            new_ids = append_output_tokens(request, token_ids, self.max_model_len)
            proposals = model_runner_output.draft_token_ids
            if proposals is not None and req_id in proposals and not request.is_finished():
                self.drafter.take_proposal(request, proposals[req_id])
            if drafts is not None:
                forced = scheduler_output.num_forced_tokens.get(req_id, 0)
                self._verified(request, len(drafts), len(token_ids) - 1, len(new_ids), forced)
            outputs.append(make_request_output(request, new_ids, logprobs, idx))
            if request.is_finished():
                self._dequeue(request)
                self._free_request(request)
        return outputs

    def _release_placeholders(self, request: Request, count: int) -> None:
        """Async scheduling hook: one in-flight step, counted as `count` tokens, delivered
        its tokens."""

    def _verified(self, request: Request, num_drafts: int, num_accepted: int,
                  num_appended: int, num_forced: int = 0) -> None:
        """Counts a verification and forgets the KV of the rejected drafts: their positions
        are computed again, with the tokens that were kept, in the next steps; blocks that
        only they used are freed (the workers learn it with the next step).

        `num_accepted` drafts matched the model (the first `num_forced` were forced by the
        grammar); `num_appended` tokens were kept after the stop checks, which is where the
        counted acceptance ends."""
        self.drafter.record(request.request_id, num_drafts, min(num_accepted, num_appended),
                            num_forced)
        request.kept_all_drafts = num_accepted == num_drafts
        if request.status != RequestStatus.RUNNING:
            return  # finished (freed next), or preempted: it owns no blocks
        request.num_computed_tokens -= num_drafts - num_accepted
        req_id = request.request_id
        before = len(self.kv_cache_manager.get_block_ids(req_id))
        kept = self.kv_cache_manager.trim(req_id, request.num_computed_tokens)
        if kept < before:
            self._kept_blocks[req_id] = kept

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests that ended outside a step (e.g. grammar compile failures)."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def make_stats(self) -> EngineCoreStats:
        """A snapshot of the scheduler's and its KV cache's gauges and counters.

        This record is what the engine core sends and what /metrics renders, unchanged.
        """
        manager = self.structured_output_manager
        return EngineCoreStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            num_aborted_requests=self.num_aborted_requests,
            timestamp=time.time(),
            kv=self.kv_cache_manager.make_stats(),
            spec=self.drafter.stats.snapshot(),
            grammar=manager.make_stats() if manager is not None else GrammarStats(),
        )
