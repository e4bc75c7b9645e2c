"""The scheduler used with --async-scheduling: schedules a token before the previous one is known."""

from __future__ import annotations

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request


class AsyncScheduler(Scheduler):
    """A Scheduler whose steps may overlap: step N+1 is scheduled while step N is in flight.

    Every token a step will sample is counted in `Request.num_output_placeholders` until its
    value arrives in update_from_output. The base scheduling rules already count placeholders
    as tokens to feed (the runner feeds them from the device) and never schedule past
    max_tokens or max_model_len; prefix caching only ever hashes confirmed tokens.
    """

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        super()._update_after_schedule(output)
        for req_id in output.sampled_req_ids:
            self.requests[req_id].num_output_placeholders += 1

    def _release_placeholders(self, request: Request, num_tokens: int) -> None:
        request.num_output_placeholders -= num_tokens
        assert request.num_output_placeholders >= 0, request.request_id
