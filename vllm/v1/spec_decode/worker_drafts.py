"""Drafts a worker proposed (EAGLE-3), served to the scheduler's Drafter like any proposer's."""

from __future__ import annotations


class WorkerDrafts:
    """The newest drafts the runner's head proposed for each request, with the number of
    tokens they follow (docs/architecture.md §11).

    `propose_batch` gives a request the drafts that continue its context: the context's
    tokens past those the drafts follow (tokens its grammar forces, drafts assumed in flight)
    must be the drafts' own first ones, and the rest follow. A request whose step is in flight
    and has no grammar gets placeholders from the Drafter instead (`fills_in_flight`): the
    runner replaces them with what it drafted after that step, which is newer than anything
    here.
    """

    # The Drafter's cue: for unconstrained requests with a step in flight, the runner drafts.
    fills_in_flight = True

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self._latest: dict[str, tuple[int, list[int]]] = {}

    def store(self, req_id: str, num_tokens: int, drafts: list[int]) -> None:
        """Keeps `drafts`, proposed after the request's first `num_tokens` tokens."""
        self._latest[req_id] = (num_tokens, drafts)

    def propose_batch(
        self, contexts: dict[str, tuple[list[int], int, int]]
    ) -> dict[str, list[int]]:
        """Drafts for each request id: `contexts[id]` is (tokens, how many of them are
        confirmed, most drafts). Returns only non-empty drafts."""
        out: dict[str, list[int]] = {}
        for req_id, (tokens, _, limit) in contexts.items():
            entry = self._latest.get(req_id)
            if entry is None or limit <= 0:
                continue
            base, drafts = entry
            if base > len(tokens):
                continue
            extra = len(tokens) - base
            if drafts[:extra] == tokens[base:] and (taken := drafts[extra : extra + limit]):
                out[req_id] = taken
        return out

    def release(self, req_id: str) -> None:
        """Forgets the request's drafts."""
        self._latest.pop(req_id, None)
