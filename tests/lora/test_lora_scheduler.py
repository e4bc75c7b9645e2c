"""The scheduler never runs more than --max-loras distinct adapters: a request with another
adapter waits (others behind it go ahead) until a running adapter's requests leave."""

from __future__ import annotations

import dataclasses

from tests.v1.core.sched_utils import demo_model_config, make_config, make_kv, make_request
from vllm.config import LoRAConfig
from vllm.lora.request import LoRARequest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus


def _with_lora(req_id: str, lora_id: int | None):
    request = make_request(req_id, 6, max_tokens=4)
    if lora_id is not None:
        request.lora_request = LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}")
    return request


def test_distinct_adapters_per_step_are_capped() -> None:
    config = dataclasses.replace(make_config(demo_model_config()),
                                 lora_config=LoRAConfig(max_loras=2))
    scheduler = Scheduler(config, make_kv(config))
    for req_id, lora_id in [("a", 1), ("b", 2), ("c", 3), ("d", None), ("e", 1)]:
        scheduler.add_request(_with_lora(req_id, lora_id))
    out = scheduler.schedule()
    admitted = {r.req_id: r.lora_request for r in out.scheduled_new_reqs}
    assert set(admitted) == {"a", "b", "d", "e"}
    assert admitted["a"] == LoRARequest("a1", 1, "/adapters/1") and admitted["d"] is None
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    # Adapter 1 leaves with both of its requests: c's adapter fits now.
    scheduler.finish_requests(["a", "e"], RequestStatus.FINISHED_ABORTED)
    out = scheduler.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["c"]
    scheduler.finish_requests(["b", "c", "d"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
