"""Speculative decoding settings (`SpeculativeConfig`, CLI: `--speculative-config JSON`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import ModelConfig
    from vllm.config.parallel import ParallelConfig
    from vllm.transformers_utils.eagle3_config import Eagle3HeadConfig

# Verification costs one forward row per draft whether it is kept or not; beyond a handful
# of tokens a lookup draft is rarely kept whole.
MAX_SPECULATIVE_TOKENS = 16
# Most forced tokens one fast-forward step appends: a JSON key with its quotes and colon is
# a few tokens; longer forced runs continue in the next step.
FAST_FORWARD_TOKENS = 8
METHODS = ("ngram", "draft_model", "grammar", "eagle3")
# Methods that read `model`.
_WITH_MODEL = ("draft_model", "eagle3")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (CLI: `--speculative-config JSON`; docs/architecture.md §11).

    Each step, a request may carry up to `num_speculative_tokens` drafted tokens that the
    model verifies in one forward pass; the tokens kept are exactly those the target model
    would have produced (greedy) or distributed as it would sample them (random).
    """

    # "ngram": prompt lookup over the request's own tokens (prompt and output).
    # "draft_model": greedy decoding with `model`, a smaller model with the same vocabulary.
    # "eagle3": an EAGLE-3 head in `model` (speculators or original EAGLE-3 layout) drafting
    # from the target's hidden states, in the worker.
    # "grammar": only what a constrained request's grammar forces next (grammar
    # fast-forward); unconstrained requests never draft.
    method: str = "ngram"
    # Most drafted tokens per request and step.
    num_speculative_tokens: int = 3
    # ngram: the shortest and longest suffix of the tokens looked up earlier in them.
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # draft_model: its directory, or a demo model name (demo-tiny drafts for demo);
    # eagle3: the head's directory.
    model: str | None = None
    # eagle3: the head as read and checked against the target (verify_with_target).
    draft_head: Eagle3HeadConfig | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.method == "eagle":
            raise ValueError(
                "--speculative-config.method: 'eagle' (EAGLE-1/2 heads, which read the "
                "target's last hidden state) is not supported; use an EAGLE-3 head with "
                "method 'eagle3'"
            )
        if self.method not in METHODS:
            raise ValueError(
                f"--speculative-config.method: {self.method!r} is not supported; use 'ngram' "
                "(prompt lookup), 'draft_model', 'eagle3' or 'grammar' (forced tokens only)"
            )
        if (self.method in _WITH_MODEL) != (self.model is not None):
            raise ValueError(
                "--speculative-config.model: required with method 'draft_model' or 'eagle3' "
                "and only with them"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"--speculative-config.{name}: must be a positive integer, got {value!r}"
                )
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"--speculative-config.num_speculative_tokens: at most "
                f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"--speculative-config.prompt_lookup_min ({self.prompt_lookup_min}) must not "
                f"exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )

    def verify_with_target(self, model_config: ModelConfig,
                           parallel_config: ParallelConfig) -> None:
        """Checks the method against the target and the layout; for eagle3, reads the head
        (config and tensor headers) into `draft_head`. Raises ValueError naming the flag or
        the head's key or file."""
        if self.method != "eagle3":
            return
        for flag, size in (("--tensor-parallel-size", parallel_config.tensor_parallel_size),
                           ("--pipeline-parallel-size", parallel_config.pipeline_parallel_size)):
            if size > 1:
                raise ValueError(
                    f"--speculative-config.method 'eagle3' runs the head beside an unsharded "
                    f"target; {flag} {size} is not supported with it")
        from vllm.transformers_utils.eagle3_config import read_eagle3_head

        assert self.model is not None
        self.draft_head = read_eagle3_head(self.model, _text_config(model_config.hf_config))


def _text_config(hf_config: Any) -> Any:
    """The language model's config (a multimodal config nests it)."""
    return getattr(hf_config, "text_config", None) or hf_config
