"""Per-step sampling parameters of a batch, one entry per batch row in batch order."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

# Rows whose temperature is below this are sampled greedily (same cut as SamplingParams.greedy).
GREEDY_TEMPERATURE = 1e-5


@dataclass
class GrammarMask:
    """Grammar bitmasks of a step's rows, on the host (CPU logits only)."""

    # [M, ceil(V / 32)] int32: bit j of word w allows token 32 * w + j.
    bitmask: np.ndarray
    # [N] int64: the bitmask row of each logits row, -1 for an unconstrained row.
    rows: np.ndarray


@dataclass
class SamplingMetadata:
    """Everything the Sampler needs for one step. Tensors are [N] on the logits' device."""

    # [N] float32; None when every row is greedy. Rows below GREEDY_TEMPERATURE are greedy.
    temperature: torch.Tensor | None
    # True when every row is greedy / when no row is greedy (lets the sampler skip work).
    all_greedy: bool
    all_random: bool
    # [N] float32, 1.0 = off; None when no row uses top-p.
    top_p: torch.Tensor | None
    # [N] int32, 0 = off; None when no row uses top-k.
    top_k: torch.Tensor | None
    # [N] float32, 0.0 = off; None when no row uses min-p.
    min_p: torch.Tensor | None
    # Per-row user seed; None = unseeded (drawn from `generator`).
    seeds: list[int | None]
    # Per row: how many tokens the request sampled before this step (seeded rows mix it in).
    output_positions: list[int]
    # Engine-wide generator for unseeded rows; None = torch's default generator.
    generator: torch.Generator | None
    # True when no row uses any penalty (the penalty fields below are then ignored).
    no_penalties: bool
    # [N] float32 each; None = that penalty is off for every row.
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    # [N, max_prompt_len] int64 padded with vocab_size; only needed when penalties are used.
    prompt_token_ids: torch.Tensor | None
    # Per row, the tokens sampled so far; only needed when penalties are used.
    output_token_ids: list[list[int]]
    # [N, P] int64 padded with vocab_size, or None: more of each row's sampled tokens, still
    # on the device only (under async scheduling); penalties count them with the above.
    pending_output_token_ids: torch.Tensor | None = None
    # Row -> (min_tokens, stop token ids): the ids are banned while
    # output_positions[row] < min_tokens.
    min_tokens: dict[int, tuple[int, set[int]]] = field(default_factory=dict)
    # None = no logprobs this step; k >= 0 = the sampled token's logprob plus the top k.
    max_num_logprobs: int | None = None
    # Row -> the only token ids it may sample (allowed_token_ids).
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Row -> (token ids, biases) added to its logits (logit_bias).
    logit_bias: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    # Row -> bad words as token sequences: a one-token word is always banned, a longer one's
    # last token where the row's newest output tokens equal the rest.
    bad_words: dict[int, list[list[int]]] = field(default_factory=dict)
    # [N, W] int64 on the logits' device: each row's newest W output tokens, right-aligned,
    # -1 before its first; None when no bad word spans several tokens.
    recent_output_token_ids: torch.Tensor | None = None
    # Grammar bitmasks the sampler applies itself (None: none, or already applied to the
    # logits): greedy rows read them in their argmax pass instead of writing -inf first.
    grammar_mask: GrammarMask | None = None

    @classmethod
    def plain(
        cls,
        temperature: torch.Tensor,
        generator: torch.Generator | None = None,
        /,
        **overrides,
    ) -> SamplingMetadata:
        """Random, unseeded rows at `temperature` ([N]) with no filters, penalties, min_tokens
        or logprobs; `overrides` replace any field (benchmarks and tests start from this)."""
        n = temperature.shape[0]
        fields = dict(
            temperature=temperature,
            all_greedy=False,
            all_random=True,
            top_p=None,
            top_k=None,
            min_p=None,
            seeds=[None] * n,
            output_positions=[0] * n,
            generator=generator,
            no_penalties=True,
            presence_penalties=None,
            frequency_penalties=None,
            repetition_penalties=None,
            prompt_token_ids=None,
            output_token_ids=[],
        )
        fields.update(overrides)
        return cls(**fields)

    def validate(self, num_rows: int, vocab_size: int) -> None:
        """Checks shapes and ranges that need no device sync.

        Raises ValueError naming the field and the problem."""

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingMetadata.{name}: {why}")

        for name in ("temperature", "top_p", "top_k", "min_p"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (num_rows,):
                raise bad(name, f"expected shape ({num_rows},), got {tuple(t.shape)}")
        if self.temperature is None and not self.all_greedy:
            raise bad("temperature", "is required unless all_greedy is set")
        if self.all_greedy and self.all_random and num_rows > 0:
            raise bad("all_random", "cannot be set together with all_greedy")
        if len(self.seeds) != num_rows:
            raise bad("seeds", f"expected {num_rows} entries, got {len(self.seeds)}")
        if len(self.output_positions) != num_rows:
            raise bad(
                "output_positions", f"expected {num_rows} entries, got {len(self.output_positions)}"
            )
        if not self.no_penalties:
            for name in ("presence_penalties", "frequency_penalties", "repetition_penalties"):
                t = getattr(self, name)
                if t is not None and tuple(t.shape) != (num_rows,):
                    raise bad(name, f"expected shape ({num_rows},), got {tuple(t.shape)}")
            p = self.prompt_token_ids
            if p is not None and (p.dim() != 2 or p.shape[0] != num_rows):
                raise bad(
                    "prompt_token_ids", f"expected shape ({num_rows}, L), got {tuple(p.shape)}"
                )
            if len(self.output_token_ids) != num_rows:
                raise bad(
                    "output_token_ids",
                    f"expected {num_rows} entries, got {len(self.output_token_ids)}",
                )
            q = self.pending_output_token_ids
            if q is not None and (q.dim() != 2 or q.shape[0] != num_rows):
                raise bad("pending_output_token_ids",
                          f"expected shape ({num_rows}, P), got {tuple(q.shape)}")
        for row in self.min_tokens:
            if not 0 <= row < num_rows:
                raise bad("min_tokens", f"row {row} is outside the batch of {num_rows}")
        g = self.grammar_mask
        if g is not None:
            if g.rows.shape != (num_rows,):
                raise bad("grammar_mask", f"expected {num_rows} rows, got {g.rows.shape}")
            if g.bitmask.ndim != 2 or g.bitmask.shape[1] * 32 < vocab_size:
                raise bad("grammar_mask", f"bitmask of shape {g.bitmask.shape} cannot mask "
                          f"{vocab_size} tokens")
        if self.max_num_logprobs is not None and not 0 <= self.max_num_logprobs <= vocab_size:
            raise bad(
                "max_num_logprobs", f"must be in [0, {vocab_size}], got {self.max_num_logprobs}"
            )
