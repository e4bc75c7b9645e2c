"""Tests for vllm/model_executor/layers/huge_pages.py: the arena hands out aligned float32
storage chunk by chunk, column_major copies into it without changing a value, and huge pages
are asked for only where Linux offers them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm.model_executor.layers import huge_pages
from vllm.model_executor.layers.column_major import column_major
from vllm.model_executor.layers.huge_pages import WeightArena


def test_the_arena_hands_out_aligned_tensors_and_starts_a_chunk_when_one_is_full() -> None:
    arena = WeightArena(chunk_bytes=4 << 20)  # advised or not, its memory is usable
    first = arena.empty(3, 5)
    second = arena.empty(7)
    assert first.shape == (3, 5) and first.is_contiguous() and first.dtype == torch.float32
    assert second.data_ptr() % 64 == 0 and second.data_ptr() > first.data_ptr()
    big = arena.empty(2 << 20)  # 8 MiB: past the chunk, so a chunk of its own
    assert big.numel() == 2 << 20 and big.data_ptr() % (2 << 20) == 0
    first.fill_(1.0)
    second.fill_(2.0)
    big.fill_(3.0)
    assert bool((first == 1.0).all()) and bool((second == 2.0).all())


def test_column_major_copies_into_the_arena_with_the_same_values() -> None:
    arena = WeightArena(chunk_bytes=4 << 20)
    matrix = torch.randn(300, 17, generator=torch.Generator().manual_seed(0))
    stored = column_major(matrix, arena)
    assert torch.equal(stored, matrix) and stored.t().is_contiguous()
    assert column_major(stored, arena) is stored  # already column-major: kept
    halves = matrix.half()
    assert torch.equal(column_major(halves, arena), halves)  # not float32: a plain copy


@pytest.mark.parametrize("mode,available", [
    ("always [madvise] never\n", True), ("[always] madvise never\n", True),
    ("always madvise [never]\n", False), (None, False),
])
def test_huge_pages_are_asked_for_only_where_linux_offers_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: str | None, available: bool
) -> None:
    path = tmp_path / "enabled"
    if mode is not None:
        path.write_text(mode)
    monkeypatch.setattr(huge_pages, "_THP_MODE", path)
    monkeypatch.setattr(huge_pages.sys, "platform", "linux")
    assert huge_pages.huge_pages_available() is available
    monkeypatch.setattr(huge_pages, "_madvise_huge", lambda address, length: True)
    assert (WeightArena.create() is not None) is available
    monkeypatch.setattr(huge_pages.sys, "platform", "darwin")
    assert not huge_pages.huge_pages_available()
