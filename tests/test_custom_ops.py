"""Tests for vllm/_custom_ops.py: native and numpy ops agree with a pure-Python oracle.

Benchmark (not a test): `.venv/bin/python benchmarks/bench_custom_ops.py`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import vllm._custom_ops as ops


def pinned(public: Callable[..., None], table: object) -> Callable[..., None]:
    """The public op, run with table's implementations whatever this process chose.

    Going through the public op keeps its argument checks, so every implementation is tested
    with the errors callers get.
    """

    def run(*args: object) -> None:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ops, "_ops", lambda: table)
            public(*args)

    return run


TABLES = {"numpy": ops._NUMPY_OPS}
if ops.HAS_NATIVE:
    TABLES["native"] = ops._NATIVE_OPS
SLOT_IMPLS = {name: pinned(ops.compute_slot_mapping, t) for name, t in TABLES.items()}
POS_IMPLS = {name: pinned(ops.prepare_positions, t) for name, t in TABLES.items()}
BITMASK_IMPLS = {name: pinned(ops.apply_token_bitmask, t) for name, t in TABLES.items()}
SLOT_IMPLS["dispatch"] = ops.compute_slot_mapping
POS_IMPLS["dispatch"] = ops.prepare_positions
BITMASK_IMPLS["dispatch"] = ops.apply_token_bitmask


def has_cxx_toolchain() -> bool:
    """True when setup.py can build the library: cmake plus some C++ compiler."""
    cxx = os.environ.get("CXX", "").split()
    compilers = ([cxx[0]] if cxx else []) + ["c++", "g++", "clang++"]
    return shutil.which("cmake") is not None and any(shutil.which(c) for c in compilers)


def slot_oracle(
    table: np.ndarray, reqs: np.ndarray, positions: np.ndarray, block_size: int
) -> list[int]:
    """Per-token slot computed with Python ints, independent of numpy indexing rules."""
    return [
        int(table[int(r)][int(p) // block_size]) * block_size + int(p) % block_size
        for r, p in zip(reqs.tolist(), positions.tolist())
    ]


def positions_oracle(computed: list[int], scheduled: list[int]) -> tuple[list[int], list[int]]:
    """Flat (request index, position) lists built token by token."""
    reqs: list[int] = []
    positions: list[int] = []
    for r, (start, count) in enumerate(zip(computed, scheduled)):
        for k in range(count):
            reqs.append(r)
            positions.append(start + k)
    return reqs, positions


def random_batch(
    rng: np.random.Generator, num_reqs: int, blocks_per_req: int, block_size: int, tokens: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A block table of distinct random block ids and random in-range (request, position) pairs."""
    num_blocks = num_reqs * blocks_per_req
    table = rng.permutation(num_blocks).astype(np.int32).reshape(num_reqs, blocks_per_req)
    reqs = rng.integers(0, num_reqs, size=tokens, dtype=np.int32)
    positions = rng.integers(0, blocks_per_req * block_size, size=tokens, dtype=np.int64)
    return table, reqs, positions


def test_native_library_builds_when_toolchain_exists() -> None:
    """A silently failed build must fail here, not just make everything slower."""
    if not has_cxx_toolchain():
        assert ops.HAS_NATIVE == (ops.find_library() is not None and not ops.native_disabled())
        return
    path = ops.find_library()
    assert path is not None, "cmake and a C++ compiler exist but vllm/_C* was not built"
    assert ops.load_library(path) is not None
    assert ops.HAS_NATIVE or ops.native_disabled()


@pytest.mark.parametrize("impl", sorted(SLOT_IMPLS))
@pytest.mark.parametrize("block_size", [1, 16, 32, 256])
def test_slot_mapping_matches_oracle(impl: str, block_size: int) -> None:
    rng = np.random.default_rng(block_size)
    table, reqs, positions = random_batch(rng, 64, 9, block_size, 2000)
    out = np.full(len(reqs), -7, dtype=np.int64)
    SLOT_IMPLS[impl](table, reqs, positions, block_size, out)
    assert out.tolist() == slot_oracle(table, reqs, positions, block_size)


@pytest.mark.parametrize("block_size", [3, 16, 64])
def test_slot_mapping_native_equals_numpy(block_size: int) -> None:
    rng = np.random.default_rng(100 + block_size)
    for tokens in (0, 1, 257, 8192):
        table, reqs, positions = random_batch(rng, 300, 17, block_size, tokens)
        results = []
        for fn in SLOT_IMPLS.values():
            out = np.zeros(tokens, dtype=np.int64)
            fn(table, reqs, positions, block_size, out)
            results.append(out)
        for other in results[1:]:
            np.testing.assert_array_equal(other, results[0])


@pytest.mark.parametrize("impl", sorted(SLOT_IMPLS))
def test_slot_mapping_large_slots_do_not_overflow_int32(impl: str) -> None:
    block_size = 1024
    table = np.array([[2**30, 5]], dtype=np.int32)
    reqs = np.zeros(3, dtype=np.int32)
    positions = np.array([0, 1023, 1025], dtype=np.int64)
    out = np.zeros(3, dtype=np.int64)
    SLOT_IMPLS[impl](table, reqs, positions, block_size, out)
    assert out.tolist() == [2**40, 2**40 + 1023, 5 * 1024 + 1]


@pytest.mark.parametrize("impl", sorted(SLOT_IMPLS))
def test_slot_mapping_empty_batch(impl: str) -> None:
    table = np.zeros((0, 4), dtype=np.int32)
    out = np.zeros(0, dtype=np.int64)
    SLOT_IMPLS[impl](table, np.zeros(0, np.int32), np.zeros(0, np.int64), 16, out)
    assert out.shape == (0,)


@pytest.mark.parametrize("impl", sorted(SLOT_IMPLS))
@pytest.mark.parametrize(
    ("req", "pos", "field"),
    [(2, 0, "req_indices"), (-1, 0, "req_indices"), (0, -1, "positions"), (0, 64, "positions")],
)
def test_slot_mapping_out_of_range_raises_and_leaves_out(
    impl: str, req: int, pos: int, field: str
) -> None:
    table = np.arange(8, dtype=np.int32).reshape(2, 4)  # 2 requests x 4 blocks of 16 tokens
    reqs = np.array([0, req], dtype=np.int32)
    positions = np.array([5, pos], dtype=np.int64)
    out = np.full(2, -1, dtype=np.int64)
    with pytest.raises(ValueError, match=field):
        SLOT_IMPLS[impl](table, reqs, positions, 16, out)
    assert out.tolist() == [-1, -1]


@pytest.mark.parametrize("impl", sorted(SLOT_IMPLS))
def test_slot_mapping_bad_arguments_raise(impl: str) -> None:
    fn = SLOT_IMPLS[impl]
    table = np.zeros((2, 4), dtype=np.int32)
    reqs = np.zeros(3, dtype=np.int32)
    positions = np.zeros(3, dtype=np.int64)
    out = np.zeros(3, dtype=np.int64)
    cases: list[tuple[tuple[object, ...], str]] = [
        ((table.astype(np.int64), reqs, positions, 16, out), "block_table"),
        ((np.asfortranarray(np.zeros((2, 4), np.int32)), reqs, positions, 16, out), "block_table"),
        ((table[:, ::2], reqs, positions, 16, out), "block_table"),
        ((table.ravel(), reqs, positions, 16, out), "block_table"),
        ((table, reqs.astype(np.int64), positions, 16, out), "req_indices"),
        ((table, reqs.tolist(), positions, 16, out), "req_indices"),
        ((table, reqs, positions.astype(np.int32), 16, out), "positions"),
        ((table, reqs, positions[:2], 16, out), "positions"),
        ((table, reqs, np.zeros(6, np.int64)[::2], 16, out), "positions"),
        ((table, reqs, positions, 16, out.astype(np.int32)), "out"),
        ((table, reqs, positions, 16, out[:2]), "out"),
        ((table, reqs, positions, 0, out), "block_size"),
        ((table, reqs, positions, 16.0, out), "block_size"),
    ]
    readonly = out.copy()
    readonly.flags.writeable = False
    cases.append(((table, reqs, positions, 16, readonly), "out"))
    for args, field in cases:
        with pytest.raises(ValueError, match=field):
            fn(*args)


@pytest.mark.parametrize("impl", sorted(POS_IMPLS))
def test_prepare_positions_matches_oracle(impl: str) -> None:
    rng = np.random.default_rng(7)
    for num_reqs in (0, 1, 5, 300):
        computed = rng.integers(0, 5000, size=num_reqs, dtype=np.int32)
        # Zero counts included: an unscheduled request contributes nothing.
        scheduled = rng.integers(0, 40, size=num_reqs, dtype=np.int32)
        total = int(scheduled.sum())
        out_reqs = np.full(total, -1, dtype=np.int32)
        out_pos = np.full(total, -1, dtype=np.int64)
        POS_IMPLS[impl](computed, scheduled, out_reqs, out_pos)
        want_reqs, want_pos = positions_oracle(computed.tolist(), scheduled.tolist())
        assert out_reqs.tolist() == want_reqs
        assert out_pos.tolist() == want_pos


def test_prepare_positions_native_equals_numpy() -> None:
    rng = np.random.default_rng(11)
    for num_reqs, max_count in ((1, 8192), (256, 1), (1024, 16), (3, 0)):
        computed = rng.integers(0, 100_000, size=num_reqs, dtype=np.int32)
        scheduled = rng.integers(0, max_count + 1, size=num_reqs, dtype=np.int32)
        total = int(scheduled.sum())
        results = []
        for fn in POS_IMPLS.values():
            out_reqs = np.zeros(total, dtype=np.int32)
            out_pos = np.zeros(total, dtype=np.int64)
            fn(computed, scheduled, out_reqs, out_pos)
            results.append((out_reqs, out_pos))
        for reqs, pos in results[1:]:
            np.testing.assert_array_equal(reqs, results[0][0])
            np.testing.assert_array_equal(pos, results[0][1])


@pytest.mark.parametrize("impl", sorted(POS_IMPLS))
def test_prepare_positions_then_slot_mapping(impl: str) -> None:
    """The two ops chained as the runner uses them give each token its own slot."""
    block_size = 16
    computed = np.array([0, 40, 7], dtype=np.int32)
    scheduled = np.array([20, 1, 9], dtype=np.int32)
    table = np.array([[3, 4, 0, 0], [9, 1, 2, 0], [5, 0, 0, 0]], dtype=np.int32)
    reqs = np.zeros(30, dtype=np.int32)
    positions = np.zeros(30, dtype=np.int64)
    POS_IMPLS[impl](computed, scheduled, reqs, positions)
    out = np.zeros(30, dtype=np.int64)
    SLOT_IMPLS[impl](table, reqs, positions, block_size, out)
    want = (
        [3 * 16 + p for p in range(16)] + [4 * 16 + p for p in range(4)]
        + [2 * 16 + 8] + [5 * 16 + p for p in range(7, 16)]
    )
    assert out.tolist() == want


@pytest.mark.parametrize("impl", sorted(POS_IMPLS))
def test_prepare_positions_bad_arguments_raise(impl: str) -> None:
    fn = POS_IMPLS[impl]
    computed = np.array([0, 3], dtype=np.int32)
    scheduled = np.array([2, 1], dtype=np.int32)
    reqs = np.zeros(3, dtype=np.int32)
    pos = np.zeros(3, dtype=np.int64)
    cases: list[tuple[tuple[object, ...], str]] = [
        ((computed.astype(np.int64), scheduled, reqs, pos), "num_computed_tokens"),
        ((computed, scheduled.astype(np.int64), reqs, pos), "num_scheduled"),
        ((computed, scheduled[:1], reqs, pos), "num_scheduled"),
        ((computed, np.zeros(4, np.int32)[::2], reqs, pos), "num_scheduled"),
        ((computed, scheduled, reqs.astype(np.int64), pos), "out_req_indices"),
        ((computed, scheduled, reqs, pos.astype(np.int32)), "out_positions"),
        ((computed, scheduled, reqs, pos[:2]), "out_positions"),
        ((computed, scheduled, np.zeros(4, np.int32), np.zeros(4, np.int64)), "sum"),
        ((computed, np.array([2, -1], np.int32), np.zeros(1, np.int32),
          np.zeros(1, np.int64)), "negative"),
        ((np.array([-5, 0], np.int32), scheduled, reqs, pos), "negative"),
    ]
    for args, field in cases:
        with pytest.raises(ValueError, match=field):
            fn(*args)
    # Errors are raised before anything is written.
    assert reqs.tolist() == [0, 0, 0] and pos.tolist() == [0, 0, 0]


def load_fresh_module(name: str) -> object:
    """Executes vllm/_custom_ops.py again as a new module, re-reading the environment."""
    spec = importlib.util.spec_from_file_location(name, ops.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # As for any import, the module is in sys.modules while it runs (dataclasses need it).
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_disable_env_falls_back_to_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = load_fresh_module("custom_ops_disabled")
    # Read at the first call, not at import.
    monkeypatch.setenv("VLLM_DISABLE_NATIVE", "1")
    assert fresh.HAS_NATIVE is False
    with pytest.raises(RuntimeError):
        fresh._NATIVE_OPS.compute_slot_mapping(
            np.zeros((1, 1), np.int32), np.zeros(0, np.int32), np.zeros(0, np.int64), 16,
            np.zeros(0, np.int64),
        )
    table = np.array([[4, 6]], dtype=np.int32)
    out = np.zeros(2, dtype=np.int64)
    fresh.compute_slot_mapping(table, np.zeros(2, np.int32), np.array([1, 17], np.int64), 16, out)
    assert out.tolist() == [4 * 16 + 1, 6 * 16 + 1]


_LAZY_SCRIPT = """
import json, numpy as np
import vllm._custom_ops as ops

def mapped():
    with open("/proc/self/maps") as f:
        return any("/vllm/_C" in line for line in f)

before = mapped()
out_reqs, out_pos = np.zeros(3, np.int32), np.zeros(3, np.int64)
ops.prepare_positions(np.array([0, 5], np.int32), np.array([2, 1], np.int32), out_reqs, out_pos)
print(json.dumps({"before": before, "after": mapped(), "has_native": ops.HAS_NATIVE,
                  "positions": out_pos.tolist()}))
"""


def test_library_loads_at_first_use_not_at_import() -> None:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_DISABLE_NATIVE"}
    proc = subprocess.run([sys.executable, "-c", _LAZY_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["before"] is False
    assert got["positions"] == [0, 1, 5]
    # HAS_NATIVE's own test (above) covers whether the library should exist at all.
    assert got["after"] is got["has_native"] is (ops.find_library() is not None)


def test_native_or_numpy_is_decided_once_for_every_op(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = load_fresh_module("custom_ops_once")
    monkeypatch.setenv("VLLM_DISABLE_NATIVE", "1")
    table = np.array([[4, 6]], dtype=np.int32)
    out = np.zeros(2, dtype=np.int64)
    fresh.compute_slot_mapping(table, np.zeros(2, np.int32), np.array([1, 17], np.int64), 16, out)
    assert out.tolist() == [4 * 16 + 1, 6 * 16 + 1]
    # The decision made at the first call holds for every op, whatever the environment says now.
    monkeypatch.delenv("VLLM_DISABLE_NATIVE")
    assert fresh.HAS_NATIVE is False
    assert fresh._ops() is fresh._NUMPY_OPS
    with pytest.raises(RuntimeError, match="not loaded"):
        fresh._NATIVE_OPS.apply_token_bitmask(
            np.zeros((1, 32), np.float32), np.zeros((1, 1), np.int32), np.zeros(0, np.int64),
            np.zeros(0, np.int64),
        )


def test_missing_or_broken_library_is_tolerated(tmp_path: Path) -> None:
    assert ops.find_library(tmp_path) is None
    broken = tmp_path / "_C.so"
    broken.write_bytes(b"not an ELF file")
    assert ops.find_library(tmp_path) == broken
    with pytest.warns(RuntimeWarning, match="ignoring native library"):
        assert ops.load_library(broken) is None


# --------------------------------------------------------------------------- apply_token_bitmask


def _random_bitmask(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """Masks shaped like a grammar's: mostly forbidden words, some full words, some mixed."""
    words = (vocab + 31) // 32
    mask = np.zeros((rows, words), dtype=np.int32)
    mask[:, rng.integers(0, words, max(1, words // 8))] = -1
    mixed = rng.integers(0, words, max(1, words // 4))
    mask[:, mixed] = rng.integers(-(2**31), 2**31 - 1, (rows, len(mixed)), dtype=np.int64)
    return mask


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 4099])
def test_apply_token_bitmask_agrees_with_xgrammar_and_numpy(vocab: int) -> None:
    import torch
    import xgrammar as xgr

    rng = np.random.default_rng(vocab)
    logits = torch.randn(6, vocab)
    mask = _random_bitmask(rng, 4, vocab)
    logit_rows = np.array([5, 0, 3], dtype=np.int64)
    mask_rows = np.array([2, 0, 3], dtype=np.int64)
    want = logits.clone()
    if vocab >= 32:  # xgrammar's kernel aborts the process on smaller vocabularies
        # With indices, xgrammar masks logits row i with bitmask row i.
        full = np.full((6, mask.shape[1]), -1, dtype=np.int32)
        full[logit_rows] = mask[mask_rows]
        xgr.apply_token_bitmask_inplace(want, torch.from_numpy(full), vocab_size=vocab,
                                        indices=logit_rows.tolist())
    else:
        BITMASK_IMPLS["numpy"](want.numpy(), mask, logit_rows, mask_rows)
    for name, impl in BITMASK_IMPLS.items():
        got = logits.clone()
        impl(got.numpy(), mask, logit_rows, mask_rows)
        assert torch.equal(got, want), name
    untouched = [1, 2, 4]
    assert torch.equal(want[untouched], logits[untouched])


@pytest.mark.parametrize("impl", sorted(BITMASK_IMPLS))
def test_apply_token_bitmask_rejects_bad_arguments(impl: str) -> None:
    fn = BITMASK_IMPLS[impl]
    logits = np.zeros((2, 64), dtype=np.float32)
    mask = np.zeros((2, 2), dtype=np.int32)
    rows = np.array([0, 1], dtype=np.int64)
    with pytest.raises(ValueError, match="logits"):
        fn(logits.astype(np.float64), mask, rows, rows)
    with pytest.raises(ValueError, match="bitmask"):
        fn(logits, np.zeros((2, 1), dtype=np.int32), rows, rows)
    with pytest.raises(ValueError, match="mask_rows"):
        fn(logits, mask, rows, rows[:1])
    with pytest.raises(ValueError, match="row index"):
        fn(logits, mask, np.array([0, 2], dtype=np.int64), rows)
    assert not logits.any()


ARGMAX_IMPLS = {name: pinned(ops.masked_argmax, t) for name, t in TABLES.items()}
ARGMAX_IMPLS["dispatch"] = ops.masked_argmax


def _tricky_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """Rows that exercise argmax's rules: few distinct values (ties), NaN, +-inf, -0.0."""
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    x[0] = np.round(x[0])  # many ties of the largest value
    x[1] = -np.inf  # no finite value: index 0
    if vocab > 3:
        x[2, vocab // 3 :: 7] = np.nan  # NaN wins, the first one
        x[3, vocab - 1] = np.inf
    x[4] = 0.0
    x[4, ::2] = -0.0  # -0.0 == 0.0: the first of them
    return x


@pytest.mark.parametrize("impl", sorted(ARGMAX_IMPLS))
@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 255, 257, 1000, 4099])
def test_masked_argmax_equals_torch_after_the_mask(impl: str, vocab: int) -> None:
    import torch

    rng = np.random.default_rng(vocab)
    logits = _tricky_logits(rng, 8, vocab)
    mask = _random_bitmask(rng, 3, vocab)
    mask[1] = 0  # a row that allows nothing
    mask_rows = np.array([-1, 0, 2, -1, 1, 0, -1, 2], dtype=np.int64)
    want = torch.from_numpy(logits.copy())
    masked = np.flatnonzero(mask_rows >= 0)
    BITMASK_IMPLS["dispatch"](want.numpy(), mask, masked, mask_rows[masked])
    got = np.full(8, -7, dtype=np.int64)
    ARGMAX_IMPLS[impl](logits, mask, mask_rows, got)
    assert got.tolist() == want.argmax(dim=1).tolist()
    plain = np.full(8, -7, dtype=np.int64)
    ARGMAX_IMPLS[impl](logits, None, None, plain)
    assert plain.tolist() == torch.from_numpy(logits).argmax(dim=1).tolist()


@pytest.mark.parametrize("impl", sorted(ARGMAX_IMPLS))
def test_masked_argmax_reads_strided_rows_without_writing(impl: str) -> None:
    rng = np.random.default_rng(0)
    wide = rng.standard_normal((4, 300)).astype(np.float32)
    view = wide[:, :257]  # rows 300 apart
    before = wide.copy()
    out = np.zeros(4, dtype=np.int64)
    ARGMAX_IMPLS[impl](view, None, None, out)
    assert out.tolist() == np.argmax(view, axis=1).tolist()
    assert np.array_equal(wide, before)


@pytest.mark.parametrize("impl", sorted(ARGMAX_IMPLS))
def test_masked_argmax_rejects_bad_arguments(impl: str) -> None:
    fn = ARGMAX_IMPLS[impl]
    logits = np.zeros((2, 64), dtype=np.float32)
    mask = np.zeros((2, 2), dtype=np.int32)
    rows = np.array([0, 1], dtype=np.int64)
    out = np.full(2, -1, dtype=np.int64)
    with pytest.raises(ValueError, match="logits"):
        fn(logits.astype(np.float64), mask, rows, out)
    with pytest.raises(ValueError, match="logits"):
        fn(np.asfortranarray(np.zeros((64, 2), dtype=np.float32)), None, None, out)
    with pytest.raises(ValueError, match="bitmask"):
        fn(logits, np.zeros((2, 1), dtype=np.int32), rows, out)
    with pytest.raises(ValueError, match="bitmask"):
        fn(logits, None, rows, out)
    with pytest.raises(ValueError, match="mask_rows"):
        fn(logits, mask, rows[:1], out)
    with pytest.raises(ValueError, match="out"):
        fn(logits, mask, rows, out[:1])
    with pytest.raises(ValueError, match="row index"):
        fn(logits, mask, np.array([0, 2], dtype=np.int64), out)
    assert out.tolist() == [-1, -1]


def _paged_problem(lens: list[int], num_heads: int, kv_heads: int, head_size: int,
                   block_size: int, seed: int) -> dict:
    """Arguments of paged_decode_attention for decodes over contexts `lens` on shuffled blocks,
    with two extra query rows no decode uses."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    nb = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(nb) + 3, generator=gen)
    table = torch.full((len(lens) + 1, max(nb) + 2), -1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(nb):
        table[r + 1, :n] = perm[used : used + n].to(torch.int32)
        used += n
    return {
        "query": torch.randn(len(lens) + 2, num_heads, head_size, generator=gen),
        "kv_cache": torch.randn(2, sum(nb) + 3, block_size, kv_heads, head_size, generator=gen),
        "block_table": table,
        "rows": torch.arange(len(lens), dtype=torch.long).flip(0) + 1,
        "table_rows": torch.arange(len(lens), dtype=torch.long) + 1,
        "seq_lens": torch.tensor(lens, dtype=torch.long),
        "scale": head_size**-0.5,
    }


def _paged_oracle(p: dict) -> "object":
    """Float64 attention of every decode of _paged_problem, by gathering its positions."""
    import torch

    kv, bs = p["kv_cache"].double(), p["kv_cache"].shape[2]
    heads, kv_heads = p["query"].shape[1], kv.shape[3]
    want = torch.zeros(p["query"].shape, dtype=torch.float64)
    for row, trow, n in zip(p["rows"].tolist(), p["table_rows"].tolist(), p["seq_lens"].tolist()):
        slots = [int(p["block_table"][trow, t // bs]) * bs + t % bs for t in range(n)]
        k = kv[0].reshape(-1, kv_heads, kv.shape[4])[slots].repeat_interleave(heads // kv_heads, 1)
        v = kv[1].reshape(-1, kv_heads, kv.shape[4])[slots].repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,lhd->hl", p["query"][row].double(), k) * p["scale"]
        want[row] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return want


@pytest.mark.skipif(not ops.HAS_NATIVE, reason="native only; HAS_NATIVE's test covers the build")
@pytest.mark.parametrize("num_heads,kv_heads,head_size", [
    (4, 2, 64), (6, 3, 20), (2, 2, 3),
    (8, 2, 40), (8, 1, 16),  # 4 and 8 query heads per KV head: one pass over the values
    (6, 2, 24), (9, 3, 64),  # 3 per KV head (SmolLM2's heads): one pass too
    (12, 1, 16),  # 12 per KV head: a pass per query head
])
def test_paged_decode_attention_matches_oracle_for_any_thread_count(
    num_heads: int, kv_heads: int, head_size: int
) -> None:
    """Float64 oracle to float32 rounding; bit-identical with 1, 2, 3 or 5 threads (a
    request's result never depends on who computes it; the two long contexts are megabytes of
    cache at the larger head sizes, enough for the kernel to spread a call over threads); rows
    no decode uses stay as they were."""
    import torch

    p = _paged_problem([1, 16, 17, 300, 5, 64, 4000, 3100], num_heads, kv_heads, head_size, 16,
                       seed=3)
    outs = []
    for threads in (1, 2, 3, 5):
        out = torch.full_like(p["query"], 7.0)
        ops.paged_decode_attention(**p, out=out, num_threads=threads)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    rows = p["rows"]
    torch.testing.assert_close(outs[0][rows].double(), _paged_oracle(p)[rows], rtol=1e-5,
                               atol=1e-6)
    assert bool((outs[0][[0, len(rows) + 1]] == 7.0).all())


@pytest.mark.skipif(not ops.HAS_NATIVE, reason="native only; HAS_NATIVE's test covers the build")
@pytest.mark.parametrize("spread", [1e-3, 40.0])
def test_paged_decode_attention_softmax_matches_oracle_from_flat_to_underflowing_scores(
    spread: float,
) -> None:
    """Scores nearly equal (every weight near 1 / len) or hundreds apart (most weights
    underflow to 0, a few dominate): the float64 oracle to float32 rounding."""
    import torch

    p = _paged_problem([1, 7, 8, 9, 250, 1000], 4, 2, 64, 16, seed=11)
    p["query"] = p["query"] * spread
    out = torch.zeros_like(p["query"])
    ops.paged_decode_attention(**p, out=out, num_threads=2)
    rows = p["rows"]
    torch.testing.assert_close(out[rows].double(), _paged_oracle(p)[rows], rtol=1e-5,
                               atol=1e-6)


@pytest.mark.skipif(not ops.HAS_NATIVE, reason="native only; HAS_NATIVE's test covers the build")
def test_paged_decode_attention_passes_a_nan_query_on_as_nan() -> None:
    """A NaN in a query head gives NaN outputs for that head, not plausible numbers; other
    heads and requests are untouched by it."""
    import torch

    p = _paged_problem([40, 40], 4, 2, 64, 16, seed=2)
    clean = torch.zeros_like(p["query"])
    ops.paged_decode_attention(**p, out=clean, num_threads=1)
    bad_row, good_row = p["rows"].tolist()
    p["query"][bad_row, 0, 5] = float("nan")
    out = torch.zeros_like(p["query"])
    ops.paged_decode_attention(**p, out=out, num_threads=1)
    assert bool(out[bad_row, 0].isnan().all())
    # Query head 1 shares head 0's KV head and its pass over the values, not its scores.
    assert torch.equal(out[bad_row, 1:], clean[bad_row, 1:])
    assert torch.equal(out[good_row], clean[good_row])


@pytest.mark.skipif(not ops.HAS_NATIVE, reason="native only; HAS_NATIVE's test covers the build")
def test_paged_decode_attention_rejects_bad_arguments() -> None:
    """Each bad argument is a ValueError naming it, and the output is left untouched."""
    import torch

    def bad(match: str, **change: object) -> None:
        out = change.pop("out", None)
        out = torch.zeros(3 + 1, 4, 8) if out is None else out
        p = _paged_problem([5, 20], 4, 2, 8, 4, seed=1)
        p.update(change)
        before = out.clone()
        with pytest.raises(ValueError, match=match):
            ops.paged_decode_attention(**p, out=out, num_threads=2)
        assert torch.equal(out, before)

    p = _paged_problem([5, 20], 4, 2, 8, 4, seed=1)
    table = p["block_table"].clone()
    table[1, 0] = p["kv_cache"].shape[1]  # a block id past the cache
    bad("block id", block_table=table)
    table = p["block_table"].clone()
    table[2, 4] = -1  # inside the 20-token context of decode 1
    bad("block id", block_table=table)
    bad("context length", seq_lens=torch.tensor([0, 20]))
    bad("context length", seq_lens=torch.tensor([5, 4 * table.shape[1] + 1]))
    bad("row is out of range", rows=torch.tensor([0, 9]))
    bad("row is out of range", table_rows=torch.tensor([1, 3]))
    bad("query: expected a torch.float32", query=p["query"].double())
    bad("kv_cache: must be contiguous", kv_cache=p["kv_cache"].transpose(3, 4))
    bad("seq_lens: length", seq_lens=torch.tensor([5]))
    bad("multiple of the KV heads", query=torch.zeros(4, 3, 8), out=torch.zeros(4, 3, 8))
    bad("out: expected rows", out=torch.zeros(4, 8, 4).transpose(1, 2))


def test_paged_decode_attention_needs_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the native library the op refuses (the torch backend then decodes itself)."""
    fresh = load_fresh_module("custom_ops_no_attention")
    monkeypatch.setenv("VLLM_DISABLE_NATIVE", "1")
    with pytest.raises(RuntimeError, match="not loaded"):
        fresh.paged_decode_attention(**_paged_problem([3], 2, 1, 4, 4, seed=0), out=None,
                                     num_threads=1)


def _dense_oracle(x: np.ndarray, w: np.ndarray, chunk: int) -> np.ndarray:
    """x @ w in dense_rows' order, float64 standing in for fused multiply-adds: a product
    of two float32 is exact in float64, and the sum is rounded to float32 at each step."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    total = None
    for c0 in range(0, x.shape[1], chunk):
        part = np.zeros((x.shape[0], w.shape[1]), np.float32)
        for k in range(c0, min(c0 + chunk, x.shape[1])):
            part = (x64[:, k : k + 1] * w64[k] + part).astype(np.float32)
        total = part if total is None else total + part
    return total


@pytest.mark.skipif(not ops.HAS_NATIVE, reason="native only; HAS_NATIVE's test covers the build")
@pytest.mark.parametrize("rows,k,n,chunk", [
    (1, 40, 300, 16), (2, 33, 50, 5), (3, 64, 1000, 64), (5, 37, 77, 128), (17, 20, 2050, 7),
    (3, 64, 9000, 16),  # wide: the columns split into several tiles
])
def test_dense_rows_sums_in_chunks_of_fused_multiply_adds(rows: int, k: int, n: int,
                                                          chunk: int) -> None:
    """Bit-equal to the order it promises; a row's result is the same alone, with other
    rows, and for any thread count; strided rows of x, w and out are read and written."""
    import torch

    gen = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k + 3, generator=gen)[:, :k]
    w = torch.randn(k, n + 5, generator=gen)[:, :n]
    out = torch.full((rows, n + 2), 7.0)
    ops.dense_rows(x, w, chunk, out[:, :n], num_threads=2)
    assert np.array_equal(out[:, :n].numpy(), _dense_oracle(x.numpy(), w.numpy(), chunk))
    assert bool((out[:, n:] == 7.0).all())
    for threads in (1, 3):
        alone = torch.empty(1, n)
        ops.dense_rows(x[-1:], w, chunk, alone, num_threads=threads)
        assert torch.equal(alone[0], out[-1, :n])
    if chunk < k:  # another chunk is another order: the test can tell them apart
        other = ops.dense_rows(x, w, k, torch.empty(rows, n))
        assert not torch.equal(other, out[:, :n])


@pytest.mark.skipif(not ops.HAS_NATIVE, reason="native only; HAS_NATIVE's test covers the build")
def test_dense_rows_rejects_bad_arguments() -> None:
    """Each bad argument is a ValueError naming it, and out is left untouched."""
    import torch

    x, w = torch.ones(2, 4), torch.ones(4, 6)

    def bad(match: str, **change: object) -> None:
        args = {"x": x, "w": w, "chunk": 2, "out": torch.zeros(2, 6)}
        args.update(change)
        before = args["out"].clone() if isinstance(args["out"], torch.Tensor) else None
        with pytest.raises(ValueError, match=match):
            ops.dense_rows(**args)
        if before is not None:
            assert torch.equal(args["out"], before)

    bad("x: expected a float32", x=x.double())
    bad("w: expected a float32", w=torch.ones(4))
    bad("out: rows must be contiguous", out=torch.zeros(6, 2).t())
    bad("x/w/out: shapes", w=torch.ones(5, 6))
    bad("x/w/out: shapes", out=torch.zeros(3, 6))
    bad("chunk: must be positive", chunk=0)
    bad("x: expected a torch tensor", x=x.numpy())


def test_dense_rows_needs_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the native library the op refuses (the BLAS then pads rows instead)."""
    import torch

    fresh = load_fresh_module("custom_ops_no_dense_rows")
    monkeypatch.setenv("VLLM_DISABLE_NATIVE", "1")
    with pytest.raises(RuntimeError, match="not loaded"):
        fresh.dense_rows(torch.ones(1, 2), torch.ones(2, 3), 1, torch.empty(1, 3))
