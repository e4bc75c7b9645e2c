"""Host inputs of one step (input_prep.prepare) and their device feedback (DeviceFeedback)."""

from __future__ import annotations

import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.worker.cuda_graph import DecodeGraphs
from vllm.v1.worker.device_feedback import DeviceFeedback
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from vllm.v1.worker.input_buffers import InputBuffers
from vllm.v1.worker.input_prep import prepare

BLOCK = 4


def _batch() -> InputBatch:
    """Two requests: a (prompt of 6, 4 computed, its next token not on the host yet: 6 known)
    and b (prompt of 3, nothing computed)."""
    batch = InputBatch(max_num_reqs=4, max_model_len=16, block_size=BLOCK)
    for req_id, prompt, blocks, computed in (("a", list(range(10, 16)), [3, 5], 4),
                                             ("b", [7, 8, 9], [1], 0)):
        batch.add(CachedRequestState(req_id, prompt, SamplingParams(), blocks, computed))
    return batch


def _output(scheduled: dict[str, int], spec: dict[str, list[int]] | None = None):
    return SchedulerOutput([], CachedRequestData(), scheduled, sum(scheduled.values()), set(),
                           scheduled_spec_decode_tokens=spec or {})


def test_prepare_builds_flat_varlen_arrays() -> None:
    inputs = prepare(_batch(), _output({"a": 3, "b": 3}), BLOCK, None, min_rows=8)
    assert inputs.req_ids == ["a", "b"] and inputs.num_tokens == 6
    assert inputs.positions.tolist() == [4, 5, 6, 0, 1, 2, 0, 0]  # padded to min_rows
    assert inputs.token_ids[:6].tolist() == [14, 15, 0, 7, 8, 9]
    assert inputs.known.tolist() == [True, True, False, True, True, True]
    assert inputs.slot_mapping.tolist() == [20, 21, 22, 4, 5, 6, -1, -1]
    assert inputs.cu.tolist() == [0, 3, 6] and inputs.seq_lens.tolist() == [7, 3]
    assert inputs.block_table[:, :2].tolist() == [[3, 5], [1, 0]]


def test_prepare_puts_drafts_at_the_end_of_their_segment() -> None:
    inputs = prepare(_batch(), _output({"a": 3}, {"a": [40, 41]}), BLOCK, None, min_rows=1)
    assert inputs.drafts == [[40, 41]]
    assert inputs.token_ids.tolist() == [14, 40, 41]
    assert inputs.known.tolist() == [True, True, True]


def test_prepare_pads_a_decode_batch_to_its_graph_size() -> None:
    graphs = DecodeGraphs([4])
    graphs.graphs = {4: object()}
    inputs = prepare(_batch(), _output({"a": 1, "b": 1}), BLOCK, graphs, min_rows=1)
    assert inputs.graph_size == 4 and inputs.padded_tokens == 4
    # Padded requests own no tokens and no context.
    assert inputs.cu.tolist() == [0, 1, 2, 2, 2] and inputs.seq_lens.tolist() == [5, 1, 0, 0]


def test_feedback_fills_unknown_inputs_from_the_rows_newest_sample() -> None:
    batch = _batch()
    feedback = DeviceFeedback(4, BLOCK, InputBuffers(8, 4, 4, torch.device("cpu")), False)
    a, b = batch.states
    feedback.write(batch, ["b", "a"], [b, a], torch.tensor([77, 66]))
    assert feedback.last_token[:2].tolist() == [66, 77]
    inputs = prepare(batch, _output({"a": 3, "b": 3}), BLOCK, None, min_rows=1)
    input_ids = torch.from_numpy(inputs.token_ids.copy())
    feedback.fill_unknown(input_ids, inputs)
    assert input_ids.tolist() == [14, 15, 66, 7, 8, 9]


def test_feedback_skips_requests_dropped_since_their_step() -> None:
    batch = _batch()
    feedback = DeviceFeedback(4, BLOCK, InputBuffers(8, 4, 4, torch.device("cpu")), False)
    a, b = batch.states
    moved = batch.remove("a")  # b moves into row 0
    feedback.move_row(*moved)
    feedback.write(batch, ["a", "b"], [a, b], torch.tensor([66, 77]))
    assert feedback.last_token.tolist() == [77, 0, 0, 0]
    assert batch.req_ids == ["b"]
