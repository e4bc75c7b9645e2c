"""The scheduler used with --async-scheduling: schedules a token before the previous one is known."""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request


class AsyncScheduler(Scheduler):
    """A Scheduler whose steps may overlap: step N+1 is scheduled while step N is in flight.

    Every token a step may sample is counted in `Request.num_output_placeholders` until its
    value arrives in update_from_output: one per step, plus the step's drafts (a
    verification may keep them all; update_from_output takes back what it rejected). A
    request that samples in several in-flight steps holds placeholders for each. The base
    scheduling rules already count placeholders as tokens to feed (the runner feeds them
    from the device) and never schedule past max_tokens or max_model_len; prefix caching
    only ever hashes confirmed tokens.

    The runner feeds an unconfirmed token from the device copy of the newest sample of its
    row, which exists only once that step's sample_tokens has run, and the workers run calls
    in issue order. So a request that samples in a step whose sample_tokens is not issued yet
    (a deferred structured-output step, or one queued behind it, docs/architecture.md §4) is
    not scheduled again until the engine reports `sampling_issued` for that step: its next
    forward would read a stale token. It simply waits; other requests are still scheduled.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Takes Scheduler's arguments."""
        super().__init__(*args, **kwargs)
        # step_id -> ids that sample in that step, for steps whose sample_tokens is not issued.
        # Ids of requests that finish meanwhile stay until then: a reused id waits a little.
        self._unsampled_steps: dict[int, frozenset[str]] = {}

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        super()._update_after_schedule(output)
        spec = output.scheduled_spec_decode_tokens
        for req_id in output.sampled_req_ids:
            request = self.requests[req_id]
            # A verification may keep every draft: until its output arrives, all count.
            request.spec_token_ids = spec.get(req_id, [])
            request.num_output_placeholders += 1 + len(request.spec_token_ids)
        if output.sampled_req_ids:
            self._unsampled_steps[output.step_id] = frozenset(output.sampled_req_ids)

    def sampling_issued(self, scheduler_output: SchedulerOutput) -> None:
        """From now on every forward runs after this step's sampling in the workers' call
        order, so it finds the step's tokens on the device: its requests may run again."""
        self._unsampled_steps.pop(scheduler_output.step_id, None)

    def _waits_for_sampling(self, request: Request) -> bool:
        if self.drafter.may_draft(request):
            if request.num_output_placeholders > 1 + len(request.spec_token_ids):
                # Two steps in flight at most: the runner places a step after the tokens
                # its previous verification kept, but a third step would be scheduled
                # while the first one's rejected drafts are still counted as computed (and
                # a stale proposal would not know the tokens between the two).
                return True
        if self.pipeline_stages > 1:
            # With pipeline stages a request runs in one in-flight step at a time: its next
            # token cannot enter the first stage before it has left the last one, so
            # scheduling it earlier would only stall the first stage. Other requests fill
            # the stages meanwhile (see Scheduler._max_batch_requests).
            return request.num_output_placeholders > 0
        # At most max_concurrent_batches steps are ever listed.
        return any(request.request_id in ids for ids in self._unsampled_steps.values())

    def _release_placeholders(self, request: Request, count: int) -> None:
        request.num_output_placeholders -= count
        assert request.num_output_placeholders >= 0, request.request_id

    def _assumed_in_flight(self, request: Request) -> list[int]:
        # A request that is scheduled now has at most one step in flight (_waits_for_sampling).
        # If the newest known verification rejected a draft, the drafts in flight assumed it
        # had not: they follow a context that did not happen, so the step is assumed to keep
        # none of them (only its first row's sample).
        if request.num_output_placeholders and request.kept_all_drafts:
            return request.spec_token_ids
        return []
