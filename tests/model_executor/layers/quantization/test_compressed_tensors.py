"""compressed-tensors schemes: reading quantization_config, and FP8 / W4A16 layers on 1
and 2 tensor-parallel ranks against the library's own dequantization."""

from __future__ import annotations

import pytest
import torch

from tests.model_executor.layers.quantization.utils_layers import column_output, row_output
from vllm.model_executor.layers.quantization.compressed_tensors import (
    CompressedInt4Method,
    CompressedTensorsConfig,
)
from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

FP8 = torch.float8_e4m3fn


def _fp8_tensors(w: torch.Tensor, per_tensor: bool) -> tuple[dict, torch.Tensor]:
    amax = w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)
    scale = amax / torch.finfo(FP8).max
    q = (w / scale).to(FP8)
    return {"weight": q, "weight_scale": scale.reshape(1) if per_tensor else scale}, \
        q.float() * scale


def _int4_tensors(w: torch.Tensor, group: int, symmetric: bool) -> tuple[dict, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    grouped = w.view(w.shape[0], -1, group)
    if symmetric:
        scale = grouped.abs().amax(-1) / 7.5
        zero = torch.zeros_like(scale, dtype=torch.int8)
    else:
        lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scale = (hi - lo) / 15
        zero = (-8 - lo / scale).round().clamp(-8, 7).to(torch.int8)
    s, z = scale.repeat_interleave(group, 1), zero.repeat_interleave(group, 1)
    q = (w / s).round().add(z).clamp(-8, 7).to(torch.int8)
    tensors = {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale,
               "weight_shape": torch.tensor(w.shape)}
    if not symmetric:
        tensors["weight_zero_point"] = pack_to_int32(zero, 4, packed_dim=0)
    return tensors, (q.float() - z.float()) * s


@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_layers_match_dequantized(per_tensor: bool, tp: int) -> None:
    gen = torch.Generator().manual_seed(tp)
    x = torch.randn(4, 64, generator=gen)
    # Parts of different magnitudes: per-tensor scales must stay per part when fused.
    parts = [_fp8_tensors(torch.randn(n, 64, generator=gen) * m, per_tensor)
             for n, m in ((64, 1.0), (32, 10.0), (32, 0.1))]
    method = Fp8LinearMethod(serialized=True, per_tensor=per_tensor)
    got = column_output(method, [{**t, "out_size": t["weight"].shape[0]} for t, _ in parts],
                        64, x, tp)
    want = x @ torch.cat([w for _, w in parts]).t()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    down, down_w = _fp8_tensors(torch.randn(48, 64, generator=gen), per_tensor)
    torch.testing.assert_close(row_output(method, down, 64, 48, x, tp), x @ down_w.t(),
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("tp", [1, 2])
def test_w4a16_layers_match_dequantized(symmetric: bool, tp: int) -> None:
    gen = torch.Generator().manual_seed(tp)
    x = torch.randn(4, 128, generator=gen)
    method = CompressedInt4Method(32, symmetric)
    parts = [_int4_tensors(torch.randn(64, 128, generator=gen), 32, symmetric)
             for _ in range(2)]
    got = column_output(method, [{**t, "out_size": 64} for t, _ in parts], 128, x, tp)
    torch.testing.assert_close(got, x @ torch.cat([w for _, w in parts]).t(), rtol=0,
                               atol=1e-4)
    down, down_w = _int4_tensors(torch.randn(64, 128, generator=gen), 32, symmetric)
    torch.testing.assert_close(row_output(method, down, 128, 64, x, tp), x @ down_w.t(),
                               rtol=0, atol=1e-4)


def _config(weights: dict, acts: dict | None = None, fmt: str = "float-quantized",
            **extra) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": group}, **extra}


FP8_CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}


def test_ignore_and_targets_pick_layers() -> None:
    config = CompressedTensorsConfig(_config(FP8_CHANNEL, ignore=[
        "lm_head", "re:.*mlp\\.gate$", "model.layers.0.self_attn.o_proj"]))
    keys = frozenset()
    assert config.linear_method(["model.layers.0.mlp.gate"], keys) is None
    assert config.linear_method(["model.layers.0.self_attn.o_proj"], keys) is None
    assert config.linear_method(["model.layers.1.self_attn.o_proj"], keys) is not None
    narrow = CompressedTensorsConfig({**_config(FP8_CHANNEL), "config_groups": {"g": {
        "targets": ["re:.*self_attn.*"], "weights": FP8_CHANNEL}}})
    assert narrow.linear_method(["model.layers.0.mlp.down_proj"], keys) is None
    assert narrow.linear_method(["model.layers.0.self_attn.q_proj"], keys) is not None


@pytest.mark.parametrize("config,match", [
    (_config({"num_bits": 8, "type": "int", "strategy": "channel"}, fmt="int-quantized"),
     r"group_0: int 8-bit weights in format 'int-quantized' are not supported"),
    (_config({**FP8_CHANNEL, "strategy": "block"}), r"weights\.strategy: 'block'"),
    (_config({"num_bits": 4, "type": "int", "strategy": "group", "group_size": None},
             fmt="pack-quantized"), r"weights\.group_size: None must be a positive integer"),
    (_config({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
             {"num_bits": 8, "type": "int", "dynamic": True}, fmt="pack-quantized"),
     r"input_activations: 4-bit weights are supported only without activation"),
    ({"quant_method": "compressed-tensors", "config_groups": {}},
     r"config_groups: missing or empty"),
])
def test_unsupported_schemes_are_named(config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CompressedTensorsConfig(config)
