"""A request's thinking budget (`thinking_token_budget`): how many reasoning tokens it may
still write before the engine ends its thinking block for it.

A model that never closes its thinking never reaches its answer, so a constrained request
would return no constrained output at all. With a budget of N, once the reply has written N
tokens inside its thinking block, the next token is forced to the parser's end token (the
scheduler gives that position a bitmask row allowing only it, docs/architecture.md §5,
"Thinking budget"); the answer then follows its constraint as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningState


@dataclass
class ThinkingBudget:
    """One reply's thinking state and the reasoning tokens it has written (its confirmed
    tokens only: tokens still in flight are not counted)."""

    parser: ReasoningParser
    # Most tokens the reply may write inside its thinking block (the markers not counted).
    limit: int
    state: ReasoningState
    # Tokens written inside the thinking block so far.
    spent: int = 0

    @classmethod
    def start(cls, parser: ReasoningParser, limit: int,
              prompt_token_ids: Sequence[int]) -> ThinkingBudget:
        """The budget of a reply to `prompt_token_ids`, before its first token."""
        return cls(parser, limit, parser.initial_state(prompt_token_ids))

    @property
    def active(self) -> bool:
        """True until the thinking block has ended (or the reply turned out not to think)."""
        return self.state != ReasoningState.ENDED

    @property
    def end_id(self) -> int:
        """The token that ends the thinking block."""
        return self.parser.end_id

    def advance(self, token: int) -> None:
        """Moves past the confirmed output `token`, counting it if it was written inside the
        thinking block (the end token itself is not counted)."""
        if self.state == ReasoningState.THINKING and token != self.parser.end_id:
            self.spent += 1
        self.state, _ = self.parser.advance(self.state, token)

    def may_run_out(self, num_in_flight: int) -> bool:
        """True when the token sampled after `num_in_flight` unconfirmed tokens may have to be
        the end token: the scheduler must then know every token before it when it makes that
        position's bitmask (it defers the bitmask as it does for grammars)."""
        return self.active and self.spent + num_in_flight >= self.limit

    @property
    def must_end(self) -> bool:
        """True when the next token must be the end token: the reply is thinking and has
        written `limit` tokens there."""
        return self.state == ReasoningState.THINKING and self.spent >= self.limit
