"""Drafting for speculative decoding, as the scheduler asks for it once per step."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.request import Request
from vllm.v1.spec_decode.proposer import ForcedTokensOnly, Proposer
from vllm.v1.structured_output.backend_types import StructuredOutputGrammar


@dataclass
class SpecDecodeStats:
    """Cumulative counters of verifications, as the engine's stats record reports them."""

    # Verification steps that carried drafts.
    num_steps: int = 0
    # Drafted tokens sent for verification.
    num_draft_tokens: int = 0
    # Drafted tokens the target model kept (and the stop checks let through).
    num_accepted_tokens: int = 0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """Counts one verification of `num_drafts` drafts of which `num_accepted` were kept."""
        self.num_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted


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


class Drafter:
    """Drafts for the decoding requests of a step and counts their verifications.

    It runs in the engine core, between scheduling and the forward: a constrained request's
    drafts are walked through its grammar as it stands after the tokens accepted so far
    (and, under async scheduling, the tokens assumed in flight), which only the scheduler's
    request state holds at that moment. `proposer` None drafts nothing (the stats stay 0).
    """

    def __init__(self, proposer: Proposer | None, max_model_len: int) -> None:
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()

    def may_draft(self, request: Request) -> bool:
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
        contexts: dict[str, _Context] = {}
        for request, assumed in candidates:
            if forced_only and request.structured_output_request is None:
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
            if tokens := _finish(context, proposed.get(req_id, [])):
                drafts[req_id] = tokens
        return drafts

    def release(self, req_id: str) -> None:
        """Forgets whatever the proposer keeps for a finished request."""
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
            assumed, head = grammar_after(request.request_id, structured_req.grammar, assumed)
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
        return _Context(request, tokens, limit - len(head), head, grammar_assumed, bool(pending))


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
    if context.guessed:
        tokens = tokens[1:]
    return tokens


def grammar_after(
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
