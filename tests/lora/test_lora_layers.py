"""Unit oracle for LoRALinear: per-row slots over a fused layer equal explicit per-part
deltas, base rows stay bit-identical, and a cleared slot adds nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.lora.layers import LoRABatch, LoRALinear, lora_backend
from vllm.model_executor.layers.linear import MergedColumnParallelLinear


# "triton" runs in Triton's interpreter without CUDA (tests/conftest.py turns it on).
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_layer_gives_each_part_its_own_delta(backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    base = MergedColumnParallelLinear(8, [6, 4])
    with torch.no_grad():
        base.weight.copy_(torch.randn(10, 8, generator=gen))
    batch = LoRABatch(lambda a: torch.from_numpy(a), min_rows=4, num_slots=2, backend=backend)
    layer = LoRALinear(base, 8, [6, 4], batch, max_loras=2, max_rank=3,
                       dtype=torch.float32, device=torch.device("cpu"))
    # Slot 0: both parts (ranks 3 and 2); slot 1: only part 1 (rank 1).
    a0, b0 = torch.randn(3, 8, generator=gen), torch.randn(6, 3, generator=gen)
    a1, b1 = torch.randn(2, 8, generator=gen), torch.randn(4, 2, generator=gen)
    a2, b2 = torch.randn(1, 8, generator=gen), torch.randn(4, 1, generator=gen)
    layer.set_part(0, 0, a0, b0)
    layer.set_part(0, 1, a1, b1)
    layer.set_part(1, 1, a2, b2)
    x = torch.randn(7, 8, generator=gen)
    slots = np.array([0, -1, 1, 0, 1, -1, -1])
    batch.set_token_slots(slots)
    got = layer(x)
    plain = base(x)
    want = plain.clone()
    for i, s in enumerate(slots):
        if s == 0:
            want[i, :6] += x[i] @ a0.T @ b0.T
            want[i, 6:] += x[i] @ a1.T @ b1.T
        elif s == 1:
            want[i, 6:] += x[i] @ a2.T @ b2.T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[slots == -1], plain[slots == -1])
    layer.clear_slot(0)
    torch.testing.assert_close(layer(x)[slots == 0], plain[slots == 0])
    batch.clear()
    assert torch.equal(layer(x), plain)


def test_the_environment_names_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_LORA_BACKEND", raising=False)
    assert lora_backend() == "torch"
    monkeypatch.setenv("VLLM_LORA_BACKEND", "Triton")
    assert lora_backend() == "triton"
    monkeypatch.setenv("VLLM_LORA_BACKEND", "punica")
    with pytest.raises(ValueError, match="VLLM_LORA_BACKEND: 'punica' is not one of"):
        lora_backend()
