"""The synchronous scheduler: one token budget per step shared by decodes and chunked prefills."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable

from vllm.config import VllmConfig
from vllm.exceptions import ErrorKind, InvalidRequestError
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.output import (
    CachedRequestData,
    GrammarOutput,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.engine.messages import EngineCoreStats
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.spec_decode.proposer import ForcedTokensOnly, Proposer
from vllm.v1.structured_output.manager import StructuredOutputManager
from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides, each step, which requests compute how many tokens, in FCFS order.

    Running requests are served first (their next token, or the rest of a chunked prefill);
    waiting requests are admitted while the token budget, `max_num_seqs` and free KV blocks
    allow. When blocks run out, the most recently admitted running request is preempted and
    recomputed later.
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
        self.waiting: deque[Request] = deque()
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
        self.proposer = proposer
        # Speculative decoding counters (cumulative): verification steps that carried drafts,
        # drafted tokens, and drafted tokens the target model kept.
        self.num_spec_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queues a request; starts compiling its grammar in the background if it has one.

        Raises ValueError when the id is already live, and whatever starting the compile
        raised; either way nothing of the request stays registered.
        """
        if request.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        if request.use_structured_output:
            assert self.structured_output_manager is not None
            try:
                self.structured_output_manager.grammar_init(request)
            except BaseException:
                self.structured_output_manager.clear(request)
                raise
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_with_error(self, request_id: str, message: str, kind: ErrorKind) -> None:
        """Ends a request with finish reason "error", `message` and `kind`, freeing everything
        it holds.

        An id the scheduler does not hold (a request that was never admitted) still gets its
        error output, so whoever sent it learns why. The output goes out with the next step.
        """
        request = self.requests.get(request_id)
        if request is not None:
            self._finish_with_error(request, message, kind)
            return
        logger.warning("request %s rejected: %s", request_id, message)
        self._pending_outputs.append(
            EngineCoreOutput(
                request_id=request_id,
                new_token_ids=[],
                finish_reason=RequestStatus.FINISHED_ERROR.finish_reason,
                error=message,
                error_kind=kind,
            )
        )

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
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request.request_id)
        if self.proposer is not None:
            self.proposer.release(request.request_id)
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
        return self.has_unfinished_requests() or bool(self.finished_req_ids) or bool(
            self._pending_outputs
        )

    # ------------------------------------------------------------------ schedule

    def _num_new_tokens(self, request: Request) -> int:
        """Tokens the request could compute now, before the budget (0: nothing to do)."""
        return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens

    def _can_sample_more(self, request: Request) -> bool:
        """False when every token the request may still produce is already sampled or in flight."""
        produced = request.num_output_tokens + request.num_output_placeholders
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and produced >= max_tokens:
            return False
        return request.num_tokens + request.num_output_placeholders < self.max_model_len

    def _max_batch_requests(self) -> int:
        """Requests one step may hold. With pipeline stages, a step takes its share of the
        unfinished requests, so that the next steps (scheduled while it is still in the
        pipeline) find requests to run and every stage stays busy."""
        if self.pipeline_stages == 1:
            return self.max_num_seqs
        share = -(-self.get_num_unfinished_requests() // self.pipeline_stages)
        return max(1, min(self.max_num_seqs, share))

    def schedule(self) -> SchedulerOutput:
        """Builds the next step. Side effects: allocates KV blocks, may preempt requests,
        admits waiting requests, and advances num_computed_tokens of every scheduled request."""
        budget = self.max_num_batched_tokens
        max_requests = self._max_batch_requests()
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: list[Request] = []
        scheduled_running: list[Request] = []
        spec_tokens: dict[str, list[int]] = {}
        proposed = self._propose_all()

        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled_running) < max_requests:
            request = self.running[i]
            num_new = min(self._num_new_tokens(request), budget)
            samples = num_new == self._num_new_tokens(request)
            if (
                num_new <= 0
                or (samples and not self._can_sample_more(request))
                or self._waits_for_sampling(request)
            ):
                i += 1
                continue
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request.request_id,
                    request.num_computed_tokens,
                    num_new,
                    request.all_token_ids,
                )
                if new_blocks is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            scheduled_running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            cached.req_ids.append(request.request_id)
            cached.resumed_from_preemption.append(False)
            cached.new_block_ids.append(new_blocks)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            if self.pipeline_stages > 1 and request.num_tokens > request.num_tokens_sent:
                # The workers take tokens from here, not from their own samples (the first
                # stage never sees a sample).
                cached.new_token_ids[request.request_id] = request.all_token_ids[
                    request.num_tokens_sent :
                ]
                request.num_tokens_sent = request.num_tokens
            i += 1

        skipped: list[Request] = []
        # Adapters of the running requests: at most max_loras, so every step fits the
        # runner's slots; a request with another adapter waits until one leaves.
        adapters = {
            r.lora_request.lora_int_id for r in self.running if r.lora_request is not None
        }
        if not preempted:
            while (
                self.waiting
                and budget > 0
                and len(self.running) < self.max_num_seqs
                and len(scheduled_running) < max_requests
            ):
                request = self.waiting[0]
                if not self._ready_to_admit(request):
                    # A request whose grammar failed has left the queue already.
                    if not request.is_finished():
                        skipped.append(self.waiting.popleft())
                    continue
                lora = request.lora_request
                if (
                    lora is not None
                    and lora.lora_int_id not in adapters
                    and len(adapters) >= self.max_loras
                ):
                    skipped.append(self.waiting.popleft())
                    continue
                if request.sampling_params.prompt_logprobs is not None and not (
                    request.prompt_logprobs_sent
                ):
                    # Its prompt's logits are needed: a prefix-cache hit would skip them (and
                    # is not looked up, so the hit statistics count only hits that are used).
                    hit_blocks, num_hit = [], 0
                else:
                    hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(
                        request.request_id, request.all_token_ids,
                        lora.cache_salt if lora is not None else None,
                    )
                num_new = min(request.num_tokens - num_hit, budget)
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request.request_id, num_hit, num_new, request.all_token_ids, hit_blocks
                )
                if new_blocks is None:
                    break
                self.waiting.popleft()
                request.num_computed_tokens = num_hit
                if request.status == RequestStatus.PREEMPTED:
                    cached.req_ids.append(request.request_id)
                    cached.resumed_from_preemption.append(True)
                    cached.new_block_ids.append(
                        self.kv_cache_manager.get_block_ids(request.request_id)
                    )
                    cached.num_computed_tokens.append(num_hit)
                    cached.resumed_req_token_ids[request.request_id] = list(request.all_token_ids)
                    cached.resumed_num_output_tokens[request.request_id] = (
                        request.num_output_tokens
                    )
                    request.num_tokens_sent = request.num_tokens
                else:
                    request.num_cached_tokens = num_hit
                    request.num_tokens_sent = request.num_tokens
                    new_reqs.append(
                        NewRequestData(
                            req_id=request.request_id,
                            prompt_token_ids=request.prompt_token_ids,
                            sampling_params=request.sampling_params,
                            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                            num_computed_tokens=num_hit,
                            lora_request=request.lora_request,
                        )
                    )
                request.status = RequestStatus.RUNNING
                if lora is not None:
                    adapters.add(lora.lora_int_id)
                self.running.append(request)
                scheduled_running.append(request)
                num_scheduled[request.request_id] = num_new
                budget -= num_new
        self.waiting.extendleft(reversed(skipped))

        # Drafts last: they get only the budget and blocks that every regular token and
        # admission left, so they never cost another request its place.
        for index, req_id in enumerate(cached.req_ids):
            drafts = proposed.get(req_id)
            if not drafts or budget <= 0 or cached.resumed_from_preemption[index]:
                continue
            request = self.requests[req_id]
            drafts = drafts[:budget]
            new_blocks = self.kv_cache_manager.allocate_slots(
                req_id,
                request.num_computed_tokens,
                num_scheduled[req_id] + len(drafts),
                request.all_token_ids,
            )
            if new_blocks is None:
                continue
            cached.new_block_ids[index].extend(new_blocks)
            spec_tokens[req_id] = drafts
            num_scheduled[req_id] += len(drafts)
            budget -= len(drafts)

        sampled: list[str] = []
        has_structured = False
        pending_structured = False
        for request in scheduled_running:
            n = num_scheduled[request.request_id] - len(spec_tokens.get(request.request_id, ()))
            if request.num_computed_tokens + n == request.num_tokens + request.num_output_placeholders:
                sampled.append(request.request_id)
                if request.use_structured_output:
                    has_structured = True
                    pending_structured |= request.num_output_placeholders > 0
        self._step_id += 1
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted} | self._unsent_preempted_ids,
            has_structured_output_requests=has_structured,
            pending_structured_output_tokens=pending_structured,
            sampled_req_ids=sampled,
            num_kept_blocks=self._kept_blocks,
            scheduled_spec_decode_tokens=spec_tokens,
            step_id=self._step_id,
        )
        self._kept_blocks = {}
        self.finished_req_ids = set()
        self._unsent_preempted_ids = set()
        self._update_after_schedule(output)
        return output

    def _keep_prompt_logprobs(self, request: Request | None, req_id: str, part) -> None:
        """Stores one step's prompt logprobs on the request, by prompt position."""
        if request is None or self.requests.get(req_id) is not request:
            return  # finished or aborted meanwhile
        if request.prompt_logprobs_sent:
            return  # a recompute after preemption: already reported
        first, lists = part
        for j, (ids, values, rank) in enumerate(
            zip(lists.token_ids, lists.logprobs, lists.ranks)
        ):
            request.prompt_logprobs[first + j] = (ids, values, rank)

    def _may_draft(self, request: Request) -> bool:
        """True when drafts for `request` can be verified exactly: its sampling at each
        position depends only on the model and the tokens before it, and its answer (if
        constrained) has left any thinking block."""
        if self.proposer is None:
            return False
        params = request.sampling_params
        if (
            params.logprobs is not None
            or params.has_penalties
            # A bad word's ban at a drafted position would depend on the drafts before it.
            or params.has_history_bans
            or request.num_output_tokens < params.min_tokens
        ):
            return False
        structured_req = request.structured_output_request
        return structured_req is None or (
            structured_req.grammar is not None
            and not structured_req.thinking
            and not structured_req.undecided
        )

    def _propose_all(self) -> dict[str, list[int]]:
        """Drafts for the running requests that decode next, by request id, each cut where
        the request would stop anyway (max_tokens, max_model_len) and at the first token its
        grammar rejects. The step's budget is applied by the caller. Under async scheduling a
        request with a step in flight drafts as if that step feeds the tokens
        _assumed_in_flight gives (for a constrained request, as far as its grammar accepts
        them) and then samples the proposal's first token, which is dropped.

        A constrained request first drafts what its grammar forces (jump-forward); the
        proposer continues after those."""
        if self.proposer is None:
            return {}
        contexts: dict[str, tuple[list[int], int, int]] = {}
        forced: dict[str, list[int]] = {}
        guessed: set[str] = set()
        # Constrained requests: the tokens their in-flight step is assumed to feed.
        in_flight: dict[str, list[int]] = {}
        forced_only = isinstance(self.proposer, ForcedTokensOnly)
        for request in self.running:
            if (
                self._num_new_tokens(request) != 1
                or (forced_only and request.structured_output_request is None)
                or not self._may_draft(request)
                or self._waits_for_sampling(request)  # not scheduled now: drafts are wasted
            ):
                continue
            assumed = self._assumed_in_flight(request)
            # Tokens still in flight count as produced (all drafts kept: an upper bound).
            pending = request.num_output_placeholders
            limit = min(self.max_model_len - request.num_tokens - pending - 1,
                        self.proposer.num_tokens)
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None:
                limit = min(limit, max_tokens - request.num_output_tokens - pending - 1)
            if limit <= 0:
                continue
            structured_req = request.structured_output_request
            head: list[int] = []
            if structured_req is not None:
                assert structured_req.grammar is not None
                # In-flight drafts past one the grammar now refutes will be rejected.
                assumed, head = _grammar_after(
                    request.request_id, structured_req.grammar, assumed)
                in_flight[request.request_id] = assumed
            tokens = request.all_token_ids
            if pending:
                # One step stale: the in-flight step's drafts are assumed kept, and the
                # proposal's first token guesses the token it samples after them (dropped
                # below). A wrong guess costs only rejected drafts.
                tokens = tokens + assumed
                guessed.add(request.request_id)
                limit += 1
            if head:
                head = forced[request.request_id] = head[:limit]
                tokens = tokens + head
                limit -= len(head)
            contexts[request.request_id] = (tokens, request.num_tokens, limit)
        proposed = self.proposer.propose_batch(
            {req_id: c for req_id, c in contexts.items() if c[2] > 0})
        drafts: dict[str, list[int]] = {}
        for req_id in contexts:
            tokens = forced.get(req_id, []) + proposed.get(req_id, [])
            structured_req = self.requests[req_id].structured_output_request
            if tokens and structured_req is not None:
                # Checked after the tokens in flight, the guess included: a constrained
                # request drafts as its grammar would stand if they are all kept.
                assert structured_req.grammar is not None
                assumed = in_flight[req_id]
                tokens = structured_req.grammar.validate_tokens(assumed + tokens)[len(assumed):]
            if req_id in guessed:
                tokens = tokens[1:]
            if tokens:
                drafts[req_id] = tokens
        return drafts

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

        The synchronous scheduler needs no bookkeeping: it never schedules a request whose
        token is not known yet. AsyncScheduler overrides it.
        """

    def _waits_for_sampling(self, request: Request) -> bool:
        """True while `request` must not be scheduled because its next input token is sampled
        in a step whose sample_tokens has not been issued (AsyncScheduler)."""
        return False

    def _assumed_in_flight(self, request: Request) -> list[int]:
        """For a drafting request scheduled now (not one that _waits_for_sampling): the tokens
        its in-flight step is assumed to feed before the one it samples last (its drafts,
        unless an earlier verification already refuted what they assumed); [] with nothing
        in flight, as always in the synchronous scheduler."""
        return []

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
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
                    self._finish_with_error(
                        request, structured_req.error or "grammar failed", ErrorKind.GRAMMAR
                    )
                return False
            request.status = RequestStatus.WAITING
        # A preempted request whose sampled tokens are still in flight resumes once they land.
        return request.num_output_placeholders == 0

    def _finish_with_error(self, request: Request, message: str, kind: ErrorKind) -> None:
        logger.warning("request %s failed: %s", request.request_id, message)
        request.status = RequestStatus.FINISHED_ERROR
        request.error_message = message
        request.error_kind = kind
        self._pending_outputs.append(
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.get_finish_reason(),
                error=message,
                error_kind=kind,
            )
        )
        self._dequeue(request)
        self._free_request(request)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

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
        ids = [
            req_id
            for req_id in scheduler_output.sampled_req_ids
            if (r := self.requests.get(req_id)) is not None
            and r.structured_output_request is not None
            and not r.structured_output_request.thinking
        ]
        if not ids:
            return None
        assert self.structured_output_manager is not None
        drafts = scheduler_output.scheduled_spec_decode_tokens
        bitmask = self.structured_output_manager.grammar_bitmask(self.requests, ids, drafts)
        rows = [req_id for req_id in ids for _ in range(1 + len(drafts.get(req_id, ())))]
        return GrammarOutput(structured_output_request_ids=rows, grammar_bitmask=bitmask.copy())

    # ------------------------------------------------------------------ outputs

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Appends sampled tokens, advances grammars, applies stop checks, and frees finished
        requests. Returns one output per request that produced a token or finished; tokens for
        requests that already finished or were aborted are dropped."""
        outputs = self._pending_outputs
        self._pending_outputs = []
        logprobs = model_runner_output.logprobs
        scheduled = self._step_requests.pop(scheduler_output.step_id, {})
        prompt_lps = model_runner_output.prompt_logprobs or {}
        for idx, req_id in enumerate(model_runner_output.req_ids):
            token_ids = model_runner_output.sampled_token_ids[idx]
            if req_id in prompt_lps:
                self._keep_prompt_logprobs(scheduled.get(req_id), req_id, prompt_lps[req_id])
            if not token_ids:
                continue
            request = scheduled.get(req_id)
            if request is None or self.requests.get(req_id) is not request:
                # Finished or aborted while this step was in flight (its id may have been
                # reused by a new request since).
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            self._release_placeholders(request, 1 + len(drafts or ()))
            new_ids = self._append_and_check(request, token_ids)
            if drafts is not None:
                self._verified(request, len(drafts), len(token_ids) - 1, len(new_ids))
            out = EngineCoreOutput(
                request_id=req_id,
                new_token_ids=new_ids,
                finish_reason=request.get_finish_reason(),
                stop_reason=request.stop_reason,
                error=request.error_message,
                error_kind=request.error_kind,
                num_cached_tokens=request.num_cached_tokens,
            )
            if (
                request.sampling_params.prompt_logprobs is not None
                and not request.prompt_logprobs_sent
            ):
                # Sent even when empty (a one-token prompt): the first output says "done".
                out.prompt_logprobs = [request.prompt_logprobs[p]
                                       for p in sorted(request.prompt_logprobs)]
                request.prompt_logprobs_sent = True
                request.prompt_logprobs = {}
            if logprobs is not None and request.sampling_params.logprobs is not None and new_ids:
                # One sampled token per step, so one logprobs row.
                out.new_logprobs_token_ids = [logprobs.token_ids[idx]]
                out.new_logprobs = [logprobs.logprobs[idx]]
                out.new_logprobs_ranks = [logprobs.ranks[idx]]
            outputs.append(out)
            if request.is_finished():
                if request in self.running:
                    self.running.remove(request)
                else:
                    self.waiting.remove(request)
                self._free_request(request)
        return outputs

    def _release_placeholders(self, request: Request, count: int) -> None:
        """Async scheduling hook: one in-flight step, counted as `count` tokens, delivered
        its tokens."""

    def _verified(
        self, request: Request, num_drafts: int, num_accepted: int, num_appended: int
    ) -> None:
        """Counts a verification and forgets the KV of the rejected drafts: their positions
        are computed again, with the tokens that were kept, in the next steps; blocks that
        only they used are freed (the workers learn it with the next step).

        `num_accepted` drafts matched the model; `num_appended` tokens were kept after the
        stop checks, which is where the counted acceptance ends."""
        self.num_spec_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += min(num_accepted, num_appended)
        request.kept_all_drafts = num_accepted == num_drafts
        if request.status != RequestStatus.RUNNING:
            return  # finished (freed next), or preempted: it owns no blocks
        request.num_computed_tokens -= num_drafts - num_accepted
        req_id = request.request_id
        before = len(self.kv_cache_manager.get_block_ids(req_id))
        kept = self.kv_cache_manager.trim(req_id, request.num_computed_tokens)
        if kept < before:
            self._kept_blocks[req_id] = kept

    def _append_and_check(self, request: Request, token_ids: list[int]) -> list[int]:
        """Appends tokens one by one until a stop condition; returns the ones kept."""
        params = request.sampling_params
        kept: list[int] = []
        structured_req = request.structured_output_request
        for token in token_ids:
            # Thinking tokens (and the `</think>` that ends them) never reach the grammar.
            grammar = (
                structured_req.grammar
                if structured_req is not None and structured_req.advance_reasoning(token)
                else None
            )
            if grammar is not None and not grammar.accept_tokens(request.request_id, [token]):
                message = f"sampled token {token} was rejected by the request's grammar"
                logger.error("request %s: %s (engine bug)", request.request_id, message)
                request.status = RequestStatus.FINISHED_ERROR
                request.error_message = message
                # The bitmask should have excluded the token: an engine bug, not the client's.
                request.error_kind = ErrorKind.INTERNAL
                break
            request.append_output_token_ids([token])
            kept.append(token)
            if token in params.all_stop_token_ids and request.num_output_tokens >= params.min_tokens:
                request.status = RequestStatus.FINISHED_STOPPED
                if token in params.stop_token_ids:
                    request.stop_reason = token
                break
            if grammar is not None and grammar.is_terminated():
                request.status = RequestStatus.FINISHED_STOPPED
                break
            if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                break
            if request.num_tokens >= self.max_model_len:
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                break
        return kept

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests that ended outside a step (e.g. grammar compile failures)."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def _backend_choices(self) -> dict[tuple[str, str], int]:
        manager = self.structured_output_manager
        return manager.backend_choices() if manager is not None else {}

    def make_stats(self) -> EngineCoreStats:
        """A snapshot of the scheduler's and its KV cache's gauges and counters.

        This record is what the engine core sends and what /metrics renders, unchanged.
        """
        kv = self.kv_cache_manager
        prefix = kv.prefix_cache_stats
        return EngineCoreStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.num_blocks,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_aborted_requests=self.num_aborted_requests,
            spec_decode_num_steps=self.num_spec_steps,
            spec_decode_num_draft_tokens=self.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.num_accepted_tokens,
            grammar_backends=sorted(
                (backend, reason, count)
                for (backend, reason), count in self._backend_choices().items()
            ),
            timestamp=time.time(),
        )


def _grammar_after(
    req_id: str, grammar: StructuredOutputGrammar, assumed: list[int]
) -> tuple[list[int], list[int]]:
    """The longest prefix of `assumed` that `grammar` accepts, and the tokens it forces
    after that prefix (jump-forward). The grammar is left as it was."""
    assumed = grammar.validate_tokens(assumed)
    if not assumed:
        return [], grammar.jump_forward_tokens()
    before = grammar.num_processed_tokens
    grammar.accept_tokens(req_id, assumed)
    try:
        return assumed, grammar.jump_forward_tokens()
    finally:
        # By what it accepted: never past the confirmed tokens, even if the backend's
        # accept_tokens stopped short of what validate_tokens promised.
        grammar.rollback(grammar.num_processed_tokens - before)
