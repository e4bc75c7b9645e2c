"""A step's sampled tokens on their way from the device to the host.

The sampled ids stay on the device for the next step's inputs (DeviceFeedback); their host copy
runs on a side CUDA stream, so the next forward can start at once. AsyncOutput resolves a
step's ModelRunnerOutput from that copy when the engine asks for it.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.v1.outputs import AsyncModelRunnerOutput, LogprobsLists, ModelRunnerOutput
from vllm.v1.sample.sampler import LogprobsTensors
from vllm.v1.spec_decode.verify import NO_TOKEN
from vllm.v1.worker.gpu_input_batch import CachedRequestState


class SampledTokens:
    """A step's sampled ids (and logprobs) with their device-to-host copy in flight."""

    def __init__(
        self,
        req_ids: list[str],
        states: list[CachedRequestState],
        positions: list[int],
        token_ids: torch.Tensor,
        logprobs: LogprobsTensors | None,
        copy_stream,
        drafts: list[list[int]],
        proposals: torch.Tensor | None = None,
    ) -> None:
        """`proposals` ([len(req_ids), k] on the device): EAGLE-3's drafts after each
        request's new tokens, copied to the host with them (None: none)."""
        self.req_ids = req_ids
        # The states verified with drafts: how many tokens they kept is on the device only.
        self.verified = {id(state) for state, d in zip(states, drafts) if d}
        # The first new id of each request on the device (penalties read them before the
        # host copy; requests with penalties never draft, so they have only that one).
        self.device_token_ids = token_ids[:, 0]
        # The states sampled for: a finished id may be reused by a new request meanwhile.
        self.states = states
        # Output index of each row's first token: a resumed request may already hold it.
        self.positions = positions
        self._event = None
        self._lists: list[list[int]] | None = None
        # [len(req_ids), 1 + most drafts]: the kept ids of each request, then NO_TOKEN.
        tensors = [token_ids]
        self._num_proposals = int(proposals is not None)
        if proposals is not None:
            tensors.append(proposals)
        if logprobs is not None:
            tensors += [logprobs.token_ids, logprobs.logprobs, logprobs.ranks]
        if copy_stream is None:
            self._host = tensors
            return
        # Copy on a side stream so the compute stream can start the next forward at once.
        main = torch.cuda.current_stream()
        copy_stream.wait_stream(main)
        with torch.cuda.stream(copy_stream):
            self._host = [t.to("cpu", non_blocking=True) for t in tensors]
            for t in tensors:
                t.record_stream(copy_stream)
            self._event = torch.cuda.Event()
            self._event.record(copy_stream)

    def ready(self) -> bool:
        """Whether the host copy has landed (never waits)."""
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Blocks until the host copy has landed."""
        if self._event is not None:
            self._event.synchronize()

    def token_lists(self) -> list[list[int]]:
        """Each request's new token ids (one, or more after a verification with drafts); waits
        for the copy. Split once per step, in bulk (the runner's settle and the engine's output
        both read them): the lists are shared, so callers must not change them."""
        if self._lists is None:
            self.wait()
            self._lists = split_rows(self._host[0].cpu().numpy())
        return self._lists

    def logprobs(self) -> LogprobsLists | None:
        """The sampled tokens' logprobs on the host (None: none asked); waits for the copy."""
        self.wait()
        if len(self._host) == 1 + self._num_proposals:
            return None
        ids, lps, ranks = self._host[1 + self._num_proposals :]
        return LogprobsLists(ids.tolist(), lps.tolist(), ranks.tolist())


    def proposals(self) -> dict[str, list[int]] | None:
        """EAGLE-3's drafts by request id on the host (None: none); waits for the copy."""
        if not self._num_proposals:
            return None
        self.wait()
        return dict(zip(self.req_ids, self._host[1].cpu().tolist()))


def split_rows(host: np.ndarray) -> list[list[int]]:
    """The ids of each row of `host` ([rows, width] int64) other than NO_TOKEN, in order, with
    one bulk conversion to Python ints (a filter per element cost about half as much as the
    scheduler's whole update at batch 256)."""
    kept = host != NO_TOKEN
    if host.shape[1] == 1 and kept.all():
        # No drafts in the step: one token per row, no slicing needed.
        return [[t] for t in host[:, 0].tolist()]
    flat = host[kept].tolist()
    ends = np.cumsum(kept.sum(axis=1)).tolist()
    return [flat[start:end] for start, end in zip([0] + ends[:-1], ends)]


class AsyncOutput(AsyncModelRunnerOutput):
    def __init__(
        self,
        req_ids: list[str],
        sampled_req_ids: list[str],
        sampled: SampledTokens,
        prompt_logprobs: dict[str, tuple[int, LogprobsLists]] | None = None,
        failed: dict[str, str] | None = None,
    ):
        self._req_ids = req_ids
        self._sampled_req_ids = sampled_req_ids
        self._sampled = sampled
        self._prompt_logprobs = prompt_logprobs
        self._failed = failed

    def get_output(self) -> ModelRunnerOutput:
        """The step's output, rows in req_ids order; waits for the host copy."""
        lists = self._sampled.token_lists()
        lp = self._sampled.logprobs()
        proposals = self._sampled.proposals()
        if self._sampled_req_ids == self._req_ids:
            # Every request of the step sampled (a decode step): rows are already in order.
            return ModelRunnerOutput(
                req_ids=self._req_ids,
                sampled_token_ids=lists,
                logprobs=lp,
                prompt_logprobs=self._prompt_logprobs,
                failed=self._failed,
                draft_token_ids=proposals,
            )
        tokens = dict(zip(self._sampled_req_ids, lists))
        if lp is not None:
            # Rows of the sampler output follow sampled_req_ids; the output follows req_ids.
            order = {r: i for i, r in enumerate(self._sampled_req_ids)}
            idx = [order.get(r) for r in self._req_ids]
            lp = LogprobsLists(
                [lp.token_ids[i] if i is not None else [] for i in idx],
                [lp.logprobs[i] if i is not None else [] for i in idx],
                [lp.ranks[i] if i is not None else 0 for i in idx],
            )
        return ModelRunnerOutput(
            req_ids=self._req_ids,
            sampled_token_ids=[tokens.get(r, []) for r in self._req_ids],
            logprobs=lp,
            prompt_logprobs=self._prompt_logprobs,
            failed=self._failed,
            draft_token_ids=proposals,
        )
