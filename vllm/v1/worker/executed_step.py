"""What the model runner's execute_model leaves for sample_tokens (one executed step)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vllm.v1.outputs import LogprobsLists
from vllm.v1.worker.gpu_input_batch import CachedRequestState

if TYPE_CHECKING:
    from vllm.v1.spec_decode.eagle3_proposer import HeadStep


@dataclass
class ExecutedStep:
    """What execute_model leaves for sample_tokens."""

    req_ids: list[str]  # scheduled requests, batch order
    sampled_req_ids: list[str]  # the requests that sample, batch order
    # Their states, kept by reference rather than by batch row: a later step's forward may
    # run before this step is sampled, and it can move rows or drop finished and preempted
    # requests.
    sampled_states: list[CachedRequestState]
    # Drafted tokens of each sampling request ([] for most), verified by this step.
    drafts: list[list[int]]
    # [sum(num_sampled_rows), vocab] float32: a row per sampled position.
    logits: torch.Tensor | None
    # Per sampling request, how many of its first drafts are fast-forward tokens (each the
    # only token its position allows): the positions before them get no logits and no
    # sample (docs/architecture.md §11).
    skipped: list[int] = field(default_factory=list)
    # Steps with drafts: [len(drafts)] int64 on the device, the position of each sampling
    # request's last input before its drafts (where its newest kept token goes from).
    draft_bases: torch.Tensor | None = None
    # Requests with prompt_logprobs: the part of the prompt this step computed.
    prompt_logprobs: dict[str, tuple[int, LogprobsLists]] | None = None
    # Requests whose LoRA adapter failed to load this step -> why.
    failed: dict[str, str] = field(default_factory=dict)
    # The pooled tensor `logits` is a view of (CPU), given back once the step is sampled.
    logits_buffer: torch.Tensor | None = None
    # Decode steps sampled by the post-layer function (post_layer.py): [padded, hidden] the
    # last hidden state of each request, in place of `logits` (None otherwise).
    hidden_rows: torch.Tensor | None = None
    # EAGLE-3: what the head needs of this step to draft once it is sampled.
    head: HeadStep | None = None
    # EAGLE-3: [len(drafts), max drafts] on the device, each sampling request's drafts as
    # verified (the runner replaced some placeholders with its own), padded with -2 (never a
    # token); None: `drafts` holds them.
    guesses: torch.Tensor | None = None

    @property
    def num_rows(self) -> list[int]:
        return [1 + len(d) for d in self.drafts]

    @property
    def num_sampled_rows(self) -> list[int]:
        return [1 + len(d) - k for d, k in zip(self.drafts, self.skipped)]
