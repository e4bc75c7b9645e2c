"""apply_grammar_bitmask: row reordering and in-place masking, against a numpy oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.grammar_bitmask import apply_grammar_bitmask, grammar_mask, reorder_bitmask

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _random_bitmask(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    words = (vocab + 31) // 32
    bitmask = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1  # allows everything
    bitmask[1] = 0
    bitmask[1, 0] = 0b101  # allows tokens 0 and 2 only
    return bitmask


def _allowed(bitmask_row: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab].astype(bool)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [151_936, 1_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masks_exactly_the_disallowed_tokens(device: str, vocab: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(vocab)
    num_rows = 7
    ids = ["c", "a", "gone", "f", "d"]  # "gone" is not in this batch
    req_id_to_row = {"a": 0, "b": 1, "c": 5, "d": 3, "e": 4, "f": 6, "g": 2}
    bitmask = _random_bitmask(rng, len(ids), vocab)
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(0)).to(dtype)
    original = logits.clone()
    logits = logits.to(device)

    apply_grammar_bitmask(logits, GrammarOutput(ids, bitmask), req_id_to_row)

    result = logits.cpu()
    constrained = {req_id_to_row[r]: i for i, r in enumerate(ids) if r in req_id_to_row}
    for row in range(num_rows):
        if row not in constrained:
            assert torch.equal(result[row], original[row]), row  # bit-for-bit untouched
            continue
        allowed = torch.from_numpy(_allowed(bitmask[constrained[row]], vocab))
        assert torch.equal(result[row][allowed], original[row][allowed]), row
        assert torch.isneginf(result[row][~allowed]).all(), row
    assert torch.isneginf(result[req_id_to_row["c"]]).sum() == 0  # the allow-all row
    assert torch.isfinite(result[req_id_to_row["a"]]).sum() == 2


@pytest.mark.parametrize("device", DEVICES)
def test_every_row_constrained_in_shuffled_order(device: str) -> None:
    rng = np.random.default_rng(3)
    vocab, ids = 4_096, [f"r{i}" for i in range(6)]
    bitmask = _random_bitmask(rng, len(ids), vocab)
    req_id_to_row = {r: int(row) for r, row in zip(ids, rng.permutation(len(ids)))}
    logits = torch.randn(len(ids), vocab)
    expected = logits.clone()
    for i, req_id in enumerate(ids):
        allowed = torch.from_numpy(_allowed(bitmask[i], vocab))
        expected[req_id_to_row[req_id]][~allowed] = float("-inf")
    logits = logits.to(device)
    apply_grammar_bitmask(logits, GrammarOutput(ids, bitmask), req_id_to_row)
    assert torch.equal(logits.cpu(), expected)


def test_reorder_bitmask_places_rows_by_batch_index() -> None:
    bitmask = np.arange(12, dtype=np.int32).reshape(3, 4)
    out, rows = reorder_bitmask(GrammarOutput(["x", "y", "z"], bitmask), {"z": 0, "x": 4})
    assert rows == [4, 0]
    assert np.array_equal(out[4], bitmask[0]) and np.array_equal(out[0], bitmask[2])
    empty, none = reorder_bitmask(GrammarOutput(["y"], bitmask[1:2]), {"x": 0})
    assert none == [] and empty.shape == (0, 4)
    with pytest.raises(ValueError, match="one per request id"):
        reorder_bitmask(GrammarOutput(["x"], bitmask), {"x": 0})


def test_nothing_to_apply_leaves_logits_alone() -> None:
    logits = torch.randn(3, 64)
    original = logits.clone()
    apply_grammar_bitmask(logits, GrammarOutput([], np.zeros((0, 2), np.int32)), {"a": 0})
    apply_grammar_bitmask(logits, GrammarOutput(["b"], np.zeros((1, 2), np.int32)), {"a": 0})
    assert torch.equal(logits, original)


def test_bad_shapes_raise() -> None:
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="cannot mask a vocabulary of 64"):
        apply_grammar_bitmask(logits, GrammarOutput(["a"], np.zeros((1, 3), np.int32)), {"a": 0})
    with pytest.raises(ValueError, match="outside logits"):
        apply_grammar_bitmask(logits, GrammarOutput(["a"], np.zeros((1, 2), np.int32)), {"a": 5})


def test_repeated_ids_fill_consecutive_rows_from_the_requests_row() -> None:
    # Request "s" has two drafts: three bitmask rows, for logits rows 2, 3 and 4.
    source = np.arange(4 * 2, dtype=np.int32).reshape(4, 2)
    out = GrammarOutput(["a", "s", "s", "s"], source)
    bitmask, rows = reorder_bitmask(out, {"a": 0, "s": 2})
    assert rows == [0, 2, 3, 4]
    assert np.array_equal(bitmask[rows], source)
    logits = torch.zeros(5, 64)
    full = np.zeros((4, 2), dtype=np.int32)
    full[:, 0] = 1 << np.arange(4)  # row i allows token i only
    apply_grammar_bitmask(logits, GrammarOutput(["a", "s", "s", "s"], full), {"a": 0, "s": 2})
    allowed = [torch.isfinite(logits[r]).nonzero().flatten().tolist() for r in range(5)]
    assert allowed == [[0], list(range(64)), [1], [2], [3]]


def test_sampler_with_grammar_mask_equals_masking_first() -> None:
    rng = np.random.default_rng(11)
    vocab, ids = 3_000, ["c", "a", "gone", "d"]
    req_id_to_row = {"a": 0, "b": 1, "c": 4, "d": 2, "e": 3}
    out = GrammarOutput(ids, _random_bitmask(rng, len(ids), vocab))
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1))
    mask = grammar_mask(out, req_id_to_row, 5, vocab)
    assert mask.rows.tolist() == [0, -1, 2, -1, 4]
    greedy = SamplingMetadata.plain(torch.zeros(5), None, temperature=None, all_greedy=True,
                                    all_random=False)
    masked = logits.clone()
    apply_grammar_bitmask(masked, out, req_id_to_row)
    want = Sampler()(masked, greedy).sampled_token_ids
    greedy.grammar_mask = mask
    before = logits.clone()
    assert torch.equal(Sampler()(logits, greedy).sampled_token_ids, want)
    assert torch.equal(logits, before)  # the fused pass reads the mask, writes nothing


def test_grammar_mask_errors_and_empty_cases() -> None:
    bitmask = np.zeros((1, 2), dtype=np.int32)
    assert grammar_mask(GrammarOutput([], np.zeros((0, 2), np.int32)), {"a": 0}, 1, 64) is None
    assert grammar_mask(GrammarOutput(["b"], bitmask), {"a": 0}, 1, 64) is None
    with pytest.raises(ValueError, match="words per row"):
        grammar_mask(GrammarOutput(["a"], bitmask), {"a": 0}, 1, 100)
    with pytest.raises(ValueError, match="outside logits"):
        grammar_mask(GrammarOutput(["a"], bitmask), {"a": 5}, 2, 64)
