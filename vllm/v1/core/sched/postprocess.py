"""What the scheduler does with one request's share of a step's output: keeping its
prompt logprobs, appending its sampled tokens with the stop checks, and its EngineCoreOutput."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from vllm.exceptions import ErrorKind
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.core.sched.repetition import REPETITION_STOP_REASON
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.outputs import LogprobsLists
from vllm.v1.request import Request, RequestStatus
from vllm.v1.spec_decode.canonical_rows import pin_canonical_rows
from vllm.options import CANONICAL
from vllm.v1.structured_output.backends.base import StructuredOutputGrammar

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


def num_new_tokens(request: Request) -> int:
    """Tokens `request` could compute now, before any budget (0: nothing to do); tokens in
    flight count as known."""
    return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens


def can_sample_more(request: Request, max_model_len: int) -> bool:
    """False when every token `request` may still produce is already sampled or in flight."""
    produced = request.num_output_tokens + request.num_output_placeholders
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None and produced >= max_tokens:
        return False
    return request.num_tokens + request.num_output_placeholders < max_model_len


def find_cache_hit(kv_cache_manager: KVCacheManager, request: Request) -> tuple[list[int], int]:
    """The prefix-cache blocks a waiting request may start from and the tokens they hold
    (looked up, and counted in the hit statistics, only when the hit can be used)."""
    if request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
        # Its prompt's logits are needed: a hit would skip computing them.
        return [], 0
    return kv_cache_manager.get_computed_blocks(
        request.request_id, request.block_hash_tokens, request.block_hash_salt
    )


def check_stop(
    request: Request, max_model_len: int, grammar: StructuredOutputGrammar | None = None
) -> bool:
    """True when `request` must stop after its newest output token; then its status says
    why (and `stop_reason` names a stop token from `stop_token_ids`, or is
    "repetition_detected").

    In this order: a stop token once `min_tokens` are out, a `grammar` that has terminated
    (the request's grammar when the token reached it, else None), `max_tokens`,
    `max_model_len`, and a repetition (`repetition_detection`, once `min_tokens` are out).
    Called once per output token, in order: it feeds the request's repetition detector.
    """
    params = request.sampling_params
    token = request.output_token_ids[-1]
    if token in params.all_stop_token_ids and request.num_output_tokens >= params.min_tokens:
        request.status = RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
        return True
    if grammar is not None and grammar.is_terminated():
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    if request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    detector = request.repetition_detector
    if (
        detector is not None
        and detector.push(token)
        and request.num_output_tokens >= params.min_tokens
    ):
        # A stop like any other: the grammar cannot end a loop inside a JSON string.
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = REPETITION_STOP_REASON
        return True
    return False


def append_output_tokens(request: Request, token_ids: list[int], max_model_len: int) -> list[int]:
    """Appends sampled tokens to `request` one by one, advancing its grammar (and reasoning
    state, and thinking budget), until check_stop ends it; returns the tokens kept.

    A token its grammar rejects is not appended: the bitmask should have excluded it, so the
    request ends with an INTERNAL error (an engine bug, not the client's fault).
    """
    kept: list[int] = []
    structured_req = request.structured_output_request
    budget = request.thinking_budget
    for token in token_ids:
        if budget is not None:
            budget.advance(token)
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
            request.error_kind = ErrorKind.INTERNAL
            break
        request.append_output_token_ids([token])
        kept.append(token)
        if check_stop(request, max_model_len, grammar):
            break
    return kept


def keep_prompt_logprobs(request: Request, part: tuple[int, LogprobsLists]) -> None:
    """Stores one step's prompt logprobs (first prompt position, rows) on `request`, by
    prompt position; ignored once they were reported (a recompute after preemption)."""
    if request.prompt_logprobs_sent:
        return
    first, lists = part
    for j, row in enumerate(zip(lists.token_ids, lists.logprobs, lists.ranks)):
        request.prompt_logprobs[first + j] = row


def make_request_output(
    request: Request, new_ids: list[int], logprobs: LogprobsLists | None, row: int
) -> EngineCoreOutput:
    """The output of `request` for a step that appended `new_ids`, its finish state, and its
    sampled logprobs (row `row` of `logprobs`). Side effect: the first output carries the
    prompt logprobs kept so far, which are then marked sent and dropped."""
    out = EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=new_ids,
        finish_reason=request.get_finish_reason(),
        stop_reason=request.stop_reason,
        error=request.error_message,
        error_kind=request.error_kind,
        num_cached_tokens=request.num_cached_tokens,
        first_scheduled_time=take_first_scheduled_time(request),
    )
    params = request.sampling_params
    if params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
        # Sent even when empty (a one-token prompt): the first output says "done".
        out.prompt_logprobs = [request.prompt_logprobs[p] for p in sorted(request.prompt_logprobs)]
        request.prompt_logprobs_sent = True
        request.prompt_logprobs = {}
    if logprobs is not None and params.logprobs is not None and new_ids:
        # One sampled token per step, so one logprobs row.
        out.new_logprobs_token_ids = [logprobs.token_ids[row]]
        out.new_logprobs = [logprobs.logprobs[row]]
        out.new_logprobs_ranks = [logprobs.ranks[row]]
    return out


def take_first_scheduled_time(request: Request) -> float | None:
    """When `request` was first scheduled, the first time it is asked after that (then it
    is marked sent); None before its first schedule and after."""
    if request.first_scheduled_time is None or request.first_scheduled_sent:
        return None
    request.first_scheduled_sent = True
    return request.first_scheduled_time


def error_output(req_id: str, message: str, kind: ErrorKind) -> EngineCoreOutput:
    """The output that ends request `req_id` with finish reason "error", `message`, `kind`."""
    return EngineCoreOutput(
        request_id=req_id,
        new_token_ids=[],
        finish_reason=RequestStatus.FINISHED_ERROR.finish_reason,
        error=message,
        error_kind=kind,
    )


def make_grammar_output(
    manager: StructuredOutputManager, requests: dict[str, Request], step: SchedulerOutput
) -> GrammarOutput | None:
    """Bitmasks for the live constrained requests that sample in `step` outside a thinking
    block, one row per sampled position (1 + drafts, less the exact fast-forward tokens,
    which are not sampled); None when there are none. Rows of positions that canonical
    fast-forward forces allow only their canonical token. A request whose thinking budget
    is spent gets one row allowing only its reasoning parser's end token, constrained or
    not (vllm/reasoning/budget.py)."""
    ids: list[str] = []
    # Requests whose thinking budget is spent: their one row allows only the end token.
    ending: list[tuple[str, int]] = []
    for req_id in step.sampled_req_ids:
        request = requests.get(req_id)
        if request is None:
            continue
        budget = request.thinking_budget
        if budget is not None and budget.must_end:
            ending.append((req_id, budget.end_id))
        elif (request.structured_output_request is not None
              and not request.structured_output_request.thinking):
            ids.append(req_id)
    if not ids and not ending:
        return None
    drafts = step.scheduled_spec_decode_tokens
    skip = step.num_fast_forward_tokens
    bitmask = manager.grammar_bitmask(requests, ids, drafts, skip)
    if manager.fast_forward.allowed == CANONICAL:
        pin_canonical_rows(manager.fast_forward, requests, ids, drafts, step.num_forced_tokens,
                           bitmask, skip)
    rows = [req_id for req_id in ids
            for _ in range(1 + len(drafts.get(req_id, ())) - skip.get(req_id, 0))]
    if ending:
        # A request with an active budget never drafts, so one row each.
        bitmask = np.concatenate([bitmask, only_tokens([t for _, t in ending],
                                                       bitmask.shape[1])])
        rows += [req_id for req_id, _ in ending]
    return GrammarOutput(structured_output_request_ids=rows, grammar_bitmask=bitmask.copy())


def only_tokens(token_ids: list[int], words: int) -> np.ndarray:
    """Bitmask rows ([len(token_ids), words] int32), row i allowing token_ids[i] alone."""
    rows = np.zeros((len(token_ids), words), dtype=np.int32)
    for i, token in enumerate(token_ids):
        # The bit pattern of an int32 word whose bit (token % 32) alone is set.
        rows[i, token // 32] = np.array(1 << (token % 32), dtype=np.uint32).view(np.int32)
    return rows
