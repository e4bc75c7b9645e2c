"""Prompt logprobs: the logprob, rank and top-k of every prompt token a step's positions
predict, for the requests that ask for them (SamplingParams.prompt_logprobs)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm.v1.outputs import LogprobsLists
from vllm.v1.worker.gpu_input_batch import InputBatch
from vllm.v1.worker.input_prep import StepInputs

# Logits elements one slice of prompt_logprobs may hold (each is a few float32 temporaries).
_PROMPT_LOGPROBS_ELEMENTS = 1 << 25


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    to_device: Callable[[np.ndarray], torch.Tensor],
    vocab_size: int,
    batch: InputBatch,
    inputs: StepInputs,
    hidden: torch.Tensor,
) -> dict[str, tuple[int, LogprobsLists]] | None:
    """For each request of this step with prompt_logprobs: (the prompt index of its first
    predicted token, the logprob, rank and top-k of every prompt token its computed positions
    predict). None when no request asks. Reads them back to the host (a wait on non-CPU
    devices, paid only by steps that hold such requests)."""
    out: dict[str, tuple[int, LogprobsLists]] = {}
    for i, row in enumerate(inputs.rows):
        state = batch.states[row]
        k = state.sampling_params.prompt_logprobs
        prompt = state.prompt_token_ids
        first = int(inputs.starts[i])
        end = first + int(inputs.num_sched[i])
        last = min(end, len(prompt) - 1)  # position p predicts prompt[p + 1]
        if k is None or first >= last:
            continue
        lists = LogprobsLists([], [], [])
        # Vocabulary-sized temporaries per position: a long prompt goes in slices.
        step = max(1, _PROMPT_LOGPROBS_ELEMENTS // vocab_size)
        for lo in range(first, last, step):
            hi = min(last, lo + step)
            start = int(inputs.cu[i]) + lo - first
            idx = to_device(np.arange(start, start + hi - lo, dtype=np.int64))
            lp = torch.log_softmax(compute_logits(hidden[idx]).float(), dim=1)
            target = to_device(np.asarray(prompt[lo + 1 : hi + 1], np.int64))
            _append(lists, lp, target, k)
        out[batch.req_ids[row]] = (first + 1, lists)
    return out or None


def _append(lists: LogprobsLists, lp: torch.Tensor, target: torch.Tensor, k: int) -> None:
    # The prompt token's own logprob and rank first, then the top k (k = 0: none).
    chosen = lp.gather(1, target[:, None])
    lists.ranks += ((lp > chosen).sum(dim=1) + 1).tolist()
    ids, values = target[:, None], chosen
    if k > 0:
        top_values, top_ids = torch.topk(lp, k, dim=1)
        ids = torch.cat([ids, top_ids], 1)
        values = torch.cat([values, top_values], 1)
    lists.token_ids += ids.tolist()
    lists.logprobs += values.tolist()
