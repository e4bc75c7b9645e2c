"""The sampler's per-row inputs (SamplingMetadata) for the requests a step samples.

Penalties and bad words read a request's output tokens; those of steps whose device-to-host
copy has not been settled yet are gathered on the device, so building the inputs never waits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np
import torch

from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.penalties import pad_token_array
from vllm.v1.worker.gpu_input_batch import SAMPLING_FLOAT_DTYPE, TOP_K_DTYPE, CachedRequestState


class InFlightTokens(Protocol):
    """A sampled step whose host copy may still be in flight."""

    states: list[CachedRequestState]
    positions: list[int]  # each state's output index of its first token of that step
    device_token_ids: torch.Tensor  # [len(states)]


class SamplingInputs:
    """Builds SamplingMetadata; `unsettled` returns the in-flight steps, oldest first, after
    settling every copy that has landed (never waiting)."""

    def __init__(
        self,
        to_device: Callable[[np.ndarray], torch.Tensor],
        generator: torch.Generator,
        vocab_size: int,
        device: torch.device,
        unsettled: Callable[[], Iterable[InFlightTokens]],
    ) -> None:
        self.to_device = to_device
        self.generator = generator
        self.vocab_size = vocab_size
        self.device = device
        self.unsettled = unsettled

    def build(
        self, states: list[CachedRequestState], offsets: list[int] | None = None
    ) -> SamplingMetadata:
        """Sampling inputs for one row per state; row i samples output position
        num_output_tokens + offsets[i] (0 without drafts)."""
        offsets = offsets or [0] * len(states)
        params = [s.sampling_params for s in states]
        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)

        # The engine core admits only values these dtypes hold (validation.check_runner_inputs): a
        # conversion error here would fail every request of the step.
        def column(name: str, off=None, dtype=SAMPLING_FLOAT_DTYPE) -> torch.Tensor | None:
            """Per-row values of one parameter on the device; None when every row has `off`."""
            values = [getattr(p, name) for p in params]
            if off is not None and all(v == off for v in values):
                return None
            return self.to_device(np.asarray(values, dtype=dtype))

        no_penalties = not any(p.has_penalties for p in params)
        prompt_ids, output_ids, pending_ids = None, [], None
        if not no_penalties:
            prompt_ids, output_ids, pending_ids = self.penalty_history(states)
        output_positions = [s.num_output_tokens + off for s, off in zip(states, offsets)]
        min_tokens = {
            i: (p.min_tokens, set(p.all_stop_token_ids))
            for i, (p, position) in enumerate(zip(params, output_positions))
            if position < p.min_tokens and p.all_stop_token_ids
        }
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        recent = None
        bad_words = {
            i: p.bad_words_token_ids for i, p in enumerate(params) if p.bad_words_token_ids
        }
        if any(p.has_history_bans for p in params):
            width = max(len(q) for seqs in bad_words.values() for q in seqs) - 1
            recent = self._recent_output_ids(states, width)
        return SamplingMetadata(
            temperature=None if all_greedy else column("temperature"),
            all_greedy=all_greedy,
            all_random=not any(greedy),
            top_p=column("top_p", 1.0),
            top_k=column("top_k", 0, TOP_K_DTYPE),
            min_p=column("min_p", 0.0),
            seeds=[p.seed for p in params],
            output_positions=output_positions,
            generator=self.generator,
            no_penalties=no_penalties,
            presence_penalties=None if no_penalties else column("presence_penalty"),
            frequency_penalties=None if no_penalties else column("frequency_penalty"),
            repetition_penalties=None if no_penalties else column("repetition_penalty"),
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            pending_output_token_ids=pending_ids,
            min_tokens=min_tokens,
            max_num_logprobs=max(logprobs) if logprobs else None,
            allowed_token_ids={
                i: p.allowed_token_ids for i, p in enumerate(params) if p.allowed_token_ids
            },
            logit_bias={
                i: (list(p.logit_bias), [float(v) for v in p.logit_bias.values()])
                for i, p in enumerate(params)
                if p.logit_bias
            },
            bad_words=bad_words,
            recent_output_token_ids=recent,
        )

    def penalty_history(
        self, states: list[CachedRequestState]
    ) -> tuple[torch.Tensor, list[list[int]], torch.Tensor | None]:
        """What penalties count: the prompts ([len(states), longest] on the device, padded
        with vocab_size), the output tokens on the host, and those still on the device."""
        # Tokens whose host copy has not arrived come from the device (never a wait).
        pending_ids = self._pending_output_ids(states)
        prompts = pad_token_array([s.prompt_token_ids for s in states], self.vocab_size)
        output_ids = [list(s.output_token_ids) for s in states]
        return self.to_device(prompts), output_ids, pending_ids

    def _unsettled_tokens(
        self, states: list[CachedRequestState]
    ) -> tuple[list[torch.Tensor], list[list[int]]]:
        """The device tensors of the steps whose host copy has not been settled into
        `output_token_ids` yet (async scheduling), and per state the indices of its tokens in
        their concatenation, oldest first."""
        row_of = {id(state): i for i, state in enumerate(states)}
        picks: list[list[int]] = [[] for _ in states]
        parts: list[torch.Tensor] = []
        offset = 0
        for sampled in self.unsettled():
            for j, (state, position) in enumerate(zip(sampled.states, sampled.positions)):
                i = row_of.get(id(state))
                # A resumed request may hold the token already (position below its length).
                if i is not None and position >= len(state.output_token_ids):
                    picks[i].append(offset + j)
            parts.append(sampled.device_token_ids.reshape(-1).to(torch.int64))
            offset += len(sampled.states)
        return parts, picks

    def _pending_output_ids(self, states: list[CachedRequestState]) -> torch.Tensor | None:
        """[len(states), P] int64 on the device, padded with vocab_size: per state, the
        tokens it sampled in steps whose host copy has not been settled yet. None when there
        are none."""
        parts, picks = self._unsettled_tokens(states)
        width = max((len(p) for p in picks), default=0)
        if width == 0:
            return None
        offset = sum(part.numel() for part in parts)
        # The last element is the padding id, gathered wherever a row has fewer tokens.
        parts.append(torch.full((1,), self.vocab_size, dtype=torch.int64, device=self.device))
        index = np.full((len(states), width), offset, dtype=np.int64)
        for i, p in enumerate(picks):
            index[i, : len(p)] = p
        return torch.cat(parts)[self.to_device(index)]

    def _recent_output_ids(self, states: list[CachedRequestState], width: int) -> torch.Tensor:
        """[len(states), width] int64 on the device: each state's newest `width` output
        tokens, right-aligned, -1 before its first. Tokens still on the device are gathered
        there (never a wait)."""
        parts, picks = self._unsettled_tokens(states)
        offset = sum(part.numel() for part in parts)
        host: list[int] = []
        index = np.full((len(states), width), -1, dtype=np.int64)
        for i, state in enumerate(states):
            if not state.sampling_params.has_history_bans:
                continue  # its row stays all -1: no prefix to match
            tail = state.output_token_ids[-width:]
            base = offset + len(host)
            host += tail
            seq = [base + k for k in range(len(tail))] + picks[i]
            seq = seq[-width:]
            if seq:
                index[i, width - len(seq):] = seq
        pad = len(host) + offset
        index[index < 0] = pad
        parts.append(self.to_device(np.asarray(host + [-1], dtype=np.int64)))
        return torch.cat(parts)[self.to_device(index)]
