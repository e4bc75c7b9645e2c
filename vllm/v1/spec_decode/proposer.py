"""The proposer interface the Drafter drafts through, and the one the config asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class Proposer(Protocol):
    """Guesses the tokens that follow a request's tokens (docs/architecture.md §11)."""

    # Most drafts per request and step.
    num_tokens: int

    def propose_batch(
        self, contexts: dict[str, tuple[list[int], int, int]]
    ) -> dict[str, list[int]]:
        """Drafts for each request id: `contexts[id]` is (tokens, how many of them are
        confirmed, most drafts: the caller's bound, which may exceed num_tokens by one when
        the first draft guesses a token in flight). Returns only non-empty drafts."""
        ...

    def release(self, req_id: str) -> None:
        """Forgets whatever the proposer keeps for a finished request."""
        ...


def build_proposer(config: VllmConfig) -> Proposer | None:
    """The proposer of `config.speculative_config` (None without speculative decoding).
    Raises ValueError when a draft model cannot serve this target."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "grammar":
        return ForcedTokensOnly(spec.num_speculative_tokens)
    if spec.method == "ngram":
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max,
                             spec.num_speculative_tokens)
    if spec.method == "eagle3":
        from vllm.v1.spec_decode.worker_drafts import WorkerDrafts

        # The runner's head drafts (eagle3_proposer.py); the scheduler serves its drafts.
        return WorkerDrafts(spec.num_speculative_tokens)
    from vllm.model_executor.model_loader.demos import resolve_model_dir
    from vllm.v1.spec_decode.draft_model_proposer import DraftModelProposer

    mc = config.model_config
    assert spec.model is not None
    return DraftModelProposer(
        resolve_model_dir(spec.model), spec.num_speculative_tokens,
        config.scheduler_config.max_num_seqs, mc.max_model_len, mc.vocab_size, mc.device,
        mc.torch_dtype)


class ForcedTokensOnly:
    """Proposes nothing itself: the Drafter drafts what each constrained request's grammar
    forces (grammar fast-forward), and unconstrained requests do not draft."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    def propose_batch(
        self, contexts: dict[str, tuple[list[int], int, int]]
    ) -> dict[str, list[int]]:
        """No drafts beyond the forced tokens the Drafter adds."""
        return {}

    def release(self, req_id: str) -> None:
        """Nothing is kept per request."""
