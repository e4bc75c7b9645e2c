"""Drafting for speculative decoding, as the scheduler asks for it once per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.options import CANONICAL, EXACT, OFF
from vllm.v1.metrics.engine_stats import SpecDecodeStats
from vllm.v1.request import Request
from vllm.v1.spec_decode.proposer import ForcedTokensOnly, Proposer
from vllm.v1.structured_output.backends.base import StructuredOutputGrammar
from vllm.v1.structured_output.fast_forward import FastForward

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.step_builder import StepBuilder


@dataclass
class _Context:
    """What one request's proposal is asked for, before the proposer runs."""

    request: Request
    # Tokens the proposal follows: confirmed, assumed in flight, forced.
    tokens: list[int]
    # Most tokens the proposer may add after `tokens`.
    limit: int
    # Tokens its grammar forces, drafted before the proposal ([] when none).
    forced: list[int]
    # Constrained requests only: the in-flight tokens its grammar accepts (None otherwise).
    assumed: list[int] | None
    # True when the proposal's first token guesses the in-flight step's sample.
    guessed: bool
    # True when the forced tokens are certain (nothing uncertain in flight before them).
    certain: bool = False
    # Forced tokens among the drafts _finish returns (set there).
    num_forced: int = field(default=0)


class Drafter:
    """Drafts for the decoding requests of a step and counts their verifications.

    It runs in the engine core, between scheduling and the forward: a constrained request's
    drafts are walked through its grammar as it stands after the tokens accepted so far
    (and, under async scheduling, the tokens assumed in flight), which only the scheduler's
    request state holds at that moment. `proposer` None drafts nothing (the stats stay 0).

    `fast_forward` says which forced tokens a constrained request drafts (its mode, see
    fast_forward.py); None drafts no forced tokens.
    """

    def __init__(self, proposer: Proposer | None, max_model_len: int,
                 fast_forward: FastForward | None = None) -> None:
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.fast_forward = fast_forward
        self.stats = SpecDecodeStats()
        # Forced tokens among the drafts of the latest propose(), by request id, and the
        # certain ones among those (fast-forward tokens: never sampled).
        self.num_forced: dict[str, int] = {}
        self.num_fast_forward: dict[str, int] = {}
        # Forced tokens kept so far, by live request id (for num_fast_forwarded_requests).
        self._kept_forced: dict[str, int] = {}
        # Requests of the latest propose() whose drafts are placeholders the worker fills in
        # (a proposer whose drafts the worker makes: EAGLE-3).
        self.worker_filled: set[str] = set()

    def mode(self, request: Request) -> str:
        """The request's fast-forward mode (off for an unconstrained one)."""
        if request.structured_output_request is None or self.fast_forward is None:
            return OFF
        return self.fast_forward.mode(request)

    def may_draft(self, request: Request) -> bool:
        """True when drafts for `request` can be verified exactly: its sampling at each
        position depends only on the model and the tokens before it, and its answer (if
        constrained, or with a thinking budget) has left any thinking block."""
        if self.proposer is None:
            return False
        if request.thinking_budget is not None and request.thinking_budget.active:
            # Drafts could run past the budget's end, which only a bitmask row enforces.
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

    def propose(self, candidates: list[tuple[Request, list[int]]]) -> dict[str, list[int]]:
        """Drafts by request id for `candidates`: (request, tokens its in-flight step is
        assumed to feed before the one it samples, [] with nothing in flight), each a request
        scheduled for exactly its next token. Each draft is cut where the request would stop
        anyway (max_tokens, max_model_len) and at the first token its grammar rejects; the
        caller applies the step's budget. A request with a step in flight drafts as if that
        step feeds the assumed tokens (for a constrained one, as far as its grammar accepts
        them) and then samples the proposal's first token, which is dropped.

        A constrained request first drafts what its grammar forces (jump-forward); the
        proposer continues after those. Side effects: whatever the proposer keeps per
        request; every grammar is left as it was."""
        if self.proposer is None:
            return {}
        forced_only = isinstance(self.proposer, ForcedTokensOnly)
        # A worker-side proposer drafts after an in-flight step's tokens itself.
        fills = getattr(self.proposer, "fills_in_flight", False)
        contexts: dict[str, _Context] = {}
        self.num_forced = {}
        self.num_fast_forward = {}
        self.worker_filled = set()
        for request, assumed in candidates:
            if forced_only and self.mode(request) == OFF:
                continue
            context = self._context(request, assumed) if self.may_draft(request) else None
            if context is not None:
                contexts[request.request_id] = context
        proposed = self.proposer.propose_batch({
            req_id: (c.tokens, c.request.num_tokens, c.limit)
            for req_id, c in contexts.items() if c.limit > 0
        })
        drafts: dict[str, list[int]] = {}
        for req_id, context in contexts.items():
            proposal = proposed.get(req_id, [])
            if fills and context.guessed and context.assumed is None and context.limit > 0:
                # Unconstrained, its step in flight: placeholders of the count it may draft
                # (the first stands for the in-flight sample, as a guess would); the runner
                # puts its own drafts after that step's tokens in their place.
                proposal = [context.tokens[-1]] * context.limit
                self.worker_filled.add(req_id)
            if tokens := _finish(context, proposal):
                drafts[req_id] = tokens
                if context.num_forced:
                    self.num_forced[req_id] = context.num_forced
                    if context.certain:
                        self.num_fast_forward[req_id] = context.num_forced
        return drafts

    def schedule(self, step: StepBuilder, candidates: list[tuple[Request, list[int]]],
                 kv_cache_manager: KVCacheManager) -> None:
        """Adds drafts for `candidates` (as `propose` takes them) to `step`, in order, each
        cut to the budget left and only if its KV slots can be allocated (a draft that does
        not fit is dropped: drafting never preempts)."""
        drafts = self.propose(candidates)
        for request, _ in candidates:
            req_id = request.request_id
            tokens = drafts.get(req_id)
            if not tokens or step.budget <= 0:
                continue
            tokens = tokens[: step.budget]
            new_blocks = kv_cache_manager.allocate_slots(
                req_id, request.num_computed_tokens, step.num_scheduled[req_id] + len(tokens),
                request.block_hash_tokens,
            )
            if new_blocks is not None:
                step.add_drafts(req_id, tokens, new_blocks, self.num_forced.get(req_id, 0),
                                self.num_fast_forward.get(req_id, 0),
                                req_id in self.worker_filled)

    def record(self, req_id: str, num_drafts: int, num_accepted: int, num_forced: int) -> None:
        """Counts the verification of a request's `num_drafts` drafts (the first
        `num_forced` forced by its grammar), `num_accepted` of them kept."""
        kept_forced = self.stats.record(num_drafts, num_accepted, num_forced)
        if kept_forced:
            self._kept_forced[req_id] = self._kept_forced.get(req_id, 0) + kept_forced

    def take_proposal(self, request: Request, drafts: list[int]) -> None:
        """Keeps the drafts a worker proposed after the request's tokens as they stand now
        (EAGLE-3: they come with the step's output); a proposer that drafts in the engine
        core has no use for them."""
        store = getattr(self.proposer, "store", None)
        if store is not None:
            store(request.request_id, request.num_tokens, drafts)

    def release(self, req_id: str) -> None:
        """Forgets whatever the proposer keeps for a finished request, and counts it if it
        kept forced tokens."""
        if self._kept_forced.pop(req_id, 0):
            self.stats.num_fast_forwarded_requests += 1
        if self.proposer is not None:
            self.proposer.release(req_id)

    def _context(self, request: Request, assumed: list[int]) -> _Context | None:
        """What to ask the proposer for `request` (None: no room for a draft)."""
        assert self.proposer is not None
        # Tokens still in flight count as produced (all drafts kept: an upper bound).
        pending = request.num_output_placeholders
        limit = min(self.max_model_len - request.num_tokens - pending - 1,
                    self.proposer.num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - request.num_output_tokens - pending - 1)
        if limit <= 0:
            return None
        structured_req = request.structured_output_request
        head: list[int] = []
        grammar_assumed: list[int] | None = None
        if structured_req is not None:
            assert structured_req.grammar is not None
            # In-flight drafts past one the grammar now refutes will be rejected.
            assumed, head = grammar_after(request.request_id, structured_req.grammar, assumed,
                                          self._forced_tokens(request, limit + bool(pending)))
            grammar_assumed = assumed
        tokens = request.all_token_ids
        if pending:
            # One step stale: the in-flight step's drafts are assumed kept, and the
            # proposal's first token guesses the token it samples after them (dropped by
            # _finish). A wrong guess costs only rejected drafts.
            tokens = tokens + assumed
            limit += 1
        if head:
            # Only then a copy: a lookup proposer reads the confirmed tokens in place.
            head = head[:limit]
            tokens = tokens + head
        # Forced tokens are certain (the only token their position allows: exact mode's by
        # definition, canonical mode's because their rows are pinned to them) unless they
        # follow in-flight drafts that a verification may still reject (a proposer's, not
        # fast-forward's own, which are certain in turn).
        certain = not pending or isinstance(self.proposer, ForcedTokensOnly)
        return _Context(request, tokens, limit - len(head), head, grammar_assumed,
                        bool(pending), certain)

    def _forced_tokens(
        self, request: Request, limit: int
    ) -> Callable[[StructuredOutputGrammar], list[int]]:
        """How `request` drafts what its grammar forces, by its fast-forward mode."""
        mode = self.mode(request)
        forcer = self.fast_forward
        if mode == CANONICAL:
            assert forcer is not None
            return lambda grammar: forcer.canonical_tokens(grammar, limit)
        if mode == EXACT:
            assert forcer is not None
            req_id = request.request_id
            return lambda grammar: forcer.single_tokens(req_id, grammar, limit)
        return lambda grammar: []


def _finish(context: _Context, proposed: list[int]) -> list[int]:
    """The request's drafts: forced tokens then the proposal, cut at the first token its
    grammar rejects (after the assumed tokens), without the guess of an in-flight sample."""
    tokens = context.forced + proposed
    structured_req = context.request.structured_output_request
    if tokens and structured_req is not None:
        # Checked after the tokens in flight, the guess included: a constrained request
        # drafts as its grammar would stand if they are all kept.
        assert structured_req.grammar is not None and context.assumed is not None
        assumed = context.assumed
        tokens = structured_req.grammar.validate_tokens(assumed + tokens)[len(assumed):]
    num_forced = min(len(context.forced), len(tokens))
    if context.guessed:
        tokens = tokens[1:]
        num_forced = max(0, num_forced - 1)
    context.num_forced = num_forced
    return tokens


def grammar_after(
    req_id: str,
    grammar: StructuredOutputGrammar,
    assumed: list[int],
    forced: Callable[[StructuredOutputGrammar], list[int]],
) -> tuple[list[int], list[int]]:
    """The longest prefix of `assumed` that `grammar` accepts, and the tokens it forces
    after that prefix (`forced` says which: the mode's). The grammar is left as it was."""
    assumed = grammar.validate_tokens(assumed)
    if not assumed:
        return [], forced(grammar)
    before = grammar.num_processed_tokens
    grammar.accept_tokens(req_id, assumed)
    try:
        return assumed, forced(grammar)
    finally:
        # By what it accepted: never past the confirmed tokens, even if the backend's
        # accept_tokens stopped short of what validate_tokens promised.
        grammar.rollback(grammar.num_processed_tokens - before)
