"""One step under construction: what Scheduler.schedule has decided so far, and its output."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.multimodal.inputs import ImageFeature
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request, RequestStatus


@dataclass
class StepBuilder:
    """Records the requests a step schedules, in scheduling order, and the budget left;
    `build` turns them into the step's SchedulerOutput. It decides nothing itself."""

    # Tokens the step may still schedule.
    budget: int
    # Most requests the step may hold.
    max_requests: int
    # Image placeholder tokens whose images the step may still encode (see fit_images).
    encoder_budget: int = 0
    # Whether the step encodes any image yet: one image always fits an empty step.
    encodes: bool = False
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached: CachedRequestData = field(default_factory=CachedRequestData)
    # Requests preempted while the step was scheduled.
    preempted: list[Request] = field(default_factory=list)
    # Every scheduled request, running ones first, then admitted ones.
    scheduled: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Forced tokens among each request's drafts (grammar fast-forward), the first ones.
    forced: dict[str, int] = field(default_factory=dict)
    # Certain tokens among them (exact fast-forward), the first ones.
    fast_forward: dict[str, int] = field(default_factory=dict)
    # Requests whose drafts the runner fills in (EAGLE-3 under async scheduling).
    worker_drafts: set[str] = field(default_factory=set)
    # Running requests' new block ids, by id: the lists in `cached`, which drafts extend.
    _running_blocks: dict[str, list[int]] = field(default_factory=dict)

    def is_full(self) -> bool:
        """True when no budget or request slot is left."""
        return self.budget <= 0 or len(self.scheduled) >= self.max_requests

    def fit_images(self, request: Request, start: int, num_new: int, admitted: bool) -> int:
        """How many of `num_new` tokens of `request` from position `start` the encoder
        budget lets the step compute: all, or those before the first image it cannot
        encode now (0: the request waits a step). The runner encodes an image whole when a
        step first computes one of its positions: a step reaching its run, or, for a
        request being `admitted` (or resumed), starting inside it. Capping that work per
        step spreads a batch of images over steps rather than holding every running
        request's next token behind one long step; an image larger than the whole budget
        still gets an otherwise image-free step."""
        cost = 0
        for image in self._images_reached(request, start, num_new, admitted):
            if cost + image.length > self.encoder_budget and (self.encodes or cost):
                return max(image.offset - start, 0)
            cost += image.length
        return num_new

    @staticmethod
    def _images_reached(request: Request, start: int, num_new: int,
                        admitted: bool) -> list[ImageFeature]:
        """The images the runner encodes for `num_new` tokens of `request` from `start`."""
        if not request.mm_features:
            return []
        end = start + num_new
        return sorted((image for image in request.mm_features
                       if image.offset < end and image.end > start
                       and (image.offset >= start or admitted)),
                      key=lambda image: image.offset)

    def _charge_images(self, request: Request, num_new: int, admitted: bool) -> None:
        images = self._images_reached(request, request.num_computed_tokens, num_new, admitted)
        if images:
            self.encodes = True
            self.encoder_budget -= sum(image.length for image in images)

    def add_running(self, request: Request, num_new: int, new_blocks: list[int],
                    send_tokens: bool) -> None:
        """Schedules `num_new` tokens of a running request that got `new_blocks`.
        `send_tokens` (pipeline stages): the workers learn its new tokens from this step,
        which marks them sent. Charges the encoder budget for the images they reach."""
        self._charge_images(request, num_new, admitted=False)
        self._take(request, num_new)
        self.cached.add(request.request_id, new_blocks, request.num_computed_tokens)
        self._running_blocks[request.request_id] = new_blocks
        if send_tokens and request.num_tokens > request.num_tokens_sent:
            self.cached.new_token_ids[request.request_id] = request.all_token_ids[
                request.num_tokens_sent:
            ]
            request.num_tokens_sent = request.num_tokens

    def add_admitted(self, request: Request, num_new: int, block_ids: list[int]) -> None:
        """Schedules `num_new` tokens of a request leaving the waiting queue, which owns
        `block_ids` and has its prefix-cache hit in num_computed_tokens: a new request, or a
        preempted one (status still PREEMPTED) whose state the runner rebuilds. Marks all its
        tokens sent and charges the encoder budget for the images they reach."""
        self._charge_images(request, num_new, admitted=True)
        req_id = request.request_id
        num_hit = request.num_computed_tokens
        if request.status == RequestStatus.PREEMPTED:
            self.cached.add(req_id, block_ids, num_hit, resumed=True)
            self.cached.resumed_req_token_ids[req_id] = list(request.all_token_ids)
            self.cached.resumed_num_output_tokens[req_id] = request.num_output_tokens
        else:
            self.new_reqs.append(NewRequestData(
                req_id=req_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                block_ids=block_ids,
                num_computed_tokens=num_hit,
                lora_request=request.lora_request,
                mm_features=request.mm_features,
            ))
        request.num_tokens_sent = request.num_tokens
        self._take(request, num_new)

    def decoding(self) -> list[Request]:
        """The running requests scheduled so far (admitted and resumed ones excluded)."""
        return self.scheduled[: len(self._running_blocks)]

    def add_drafts(self, req_id: str, drafts: list[int], new_blocks: list[int],
                   num_forced: int = 0, num_fast_forward: int = 0,
                   worker_filled: bool = False) -> None:
        """Adds drafts after a running request's scheduled token, with the blocks they took;
        the first `num_forced` of them (at most all) are forced by its grammar, and the first
        `num_fast_forward` are certain (exact fast-forward: never sampled). `worker_filled`:
        they are placeholders the runner replaces with its own."""
        if worker_filled:
            self.worker_drafts.add(req_id)
        self._running_blocks[req_id].extend(new_blocks)
        self.spec_tokens[req_id] = drafts
        if num_forced:
            self.forced[req_id] = min(num_forced, len(drafts))
        if num_fast_forward:
            self.fast_forward[req_id] = min(num_fast_forward, len(drafts))
        self.num_scheduled[req_id] += len(drafts)
        self.budget -= len(drafts)

    def build(self, step_id: int, finished_req_ids: set[str], preempted_req_ids: set[str],
              num_kept_blocks: dict[str, int]) -> SchedulerOutput:
        """The step's SchedulerOutput. The requests that sample are those whose scheduled
        tokens (drafts aside) reach their last known or in-flight token."""
        sampled = [
            request for request in self.scheduled
            if request.num_computed_tokens + self.num_scheduled[request.request_id]
            - len(self.spec_tokens.get(request.request_id, ()))
            == request.num_tokens + request.num_output_placeholders
        ]
        # A request whose thinking budget may run out at this step's sample is masked like a
        # constrained one: from its confirmed tokens only (so the bitmask may wait).
        structured = [
            r for r in sampled
            if r.use_structured_output or (
                r.thinking_budget is not None
                and r.thinking_budget.may_run_out(r.num_output_placeholders))
        ]
        return SchedulerOutput(
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=self.cached,
            num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=sum(self.num_scheduled.values()),
            finished_req_ids=finished_req_ids,
            preempted_req_ids={r.request_id for r in self.preempted} | preempted_req_ids,
            has_structured_output_requests=bool(structured),
            pending_structured_output_tokens=any(
                r.num_output_placeholders > 0 for r in structured),
            sampled_req_ids=[r.request_id for r in sampled],
            num_kept_blocks=num_kept_blocks,
            scheduled_spec_decode_tokens=self.spec_tokens,
            num_forced_tokens=self.forced,
            num_fast_forward_tokens=self.fast_forward,
            worker_drafts=self.worker_drafts,
            step_id=step_id,
        )

    def _take(self, request: Request, num_new: int) -> None:
        self.scheduled.append(request)
        self.num_scheduled[request.request_id] = num_new
        self.budget -= num_new
