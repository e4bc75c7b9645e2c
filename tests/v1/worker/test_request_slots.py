"""The post-layer function's per-request tables: what they cost, and which rows a step reads
(their contents are checked through the post-layer function, tests/v1/worker/
test_post_layer.py)."""

from __future__ import annotations

import torch

from vllm import SamplingParams
from vllm.v1.worker.gpu_input_batch import CachedRequestState
from vllm.v1.worker.request_slots import RequestSlots, table_bytes


def _tables(history) -> RequestSlots:
    return RequestSlots(6, 100, torch.device("cpu"), torch.from_numpy, history)


def test_table_bytes_is_what_the_tables_allocate() -> None:
    for history in (None, lambda states: None):
        tables = _tables(history)
        held = [tables.masks, tables.bias_ids, tables.bias_values, tables.penalty]
        held += [t for t in (tables.counts, tables.prompt) if t is not None]
        allocated = sum(t.numel() * t.element_size() for t in held)
        assert table_bytes(6, 100, penalties=history is not None) == allocated


def test_rows_without_edits_read_the_spare_slot() -> None:
    tables = _tables(None)
    plain = [CachedRequestState(f"p{i}", [1], SamplingParams(), [], 1) for i in range(3)]
    step = tables.rows(plain)
    assert step.table_rows.tolist() == [12, 12, 12] and not step.edited
    biased = CachedRequestState("b", [1], SamplingParams(logit_bias={3: 1.0}, min_tokens=2,
                                                         stop_token_ids=[4]), [], 1)
    biased.sampling_params.update_from_model([])
    step = tables.rows([*plain, biased])
    slot = int(step.table_rows[3]) // 2
    assert step.edited and slot < 6 and step.table_rows[3] == 2 * slot + 1  # min_tokens holds
    assert tables.bias_ids[slot, 0] == 3 and tables.bias_values[slot, 0] == 1.0
    # Penalties without a history to rebuild counts from: the eager path's.
    penalized = CachedRequestState("q", [1], SamplingParams(presence_penalty=1.0), [], 1)
    assert tables.rows([*plain, penalized]) is None
