"""Tiny quantized checkpoints for the quantization tests, each with its oracle: a
transformers model holding the dequantized weights.

compressed-tensors checkpoints are written by the compressed-tensors library itself (its
QuantizationConfig, apply_quantization_config, calculate_qparams and ModelCompressor),
and its own decompression gives the oracle's weights. GPTQ and AWQ tensors are packed
here by those formats' published rules (GPTQ: 8 values per int32 along the input rows,
zeros stored minus one; AWQ: 8 values per int32 along the output columns in the order
0, 2, 4, 6, 1, 3, 5, 7), since their packing libraries are not installable here.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from tests.utils_models import hf_config, randomize

# The projections every quantized tiny checkpoint quantizes.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def tiny_hf(name: str, seed: int):
    """A random tiny transformers model (float32, eval mode) of architecture ``name``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(hf_config(name), attn_implementation="eager",
                                          dtype=torch.float32)
    randomize(hf, seed)
    return hf.eval()


def _quantized_linears(hf):
    return [(n, m) for n, m in hf.named_modules()
            if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in PROJECTIONS]


def ct_scheme(kind: str, group_size: int = 32):
    """A compressed-tensors scheme: 'fp8_channel' (dynamic per-token FP8 activations),
    'fp8_tensor' (dynamic per-tensor activations) or 'w4a16' (symmetric int4 groups)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if kind == "w4a16":
        weights = QuantizationArgs(num_bits=4, type="int", strategy="group",
                                   group_size=group_size, symmetric=True)
        return QuantizationScheme(targets=["Linear"], weights=weights)
    strategy = kind.removeprefix("fp8_")
    weights = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True)
    acts = QuantizationArgs(num_bits=8, type="float", dynamic=True,
                            strategy="token" if strategy == "channel" else "tensor")
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)


def ct_checkpoint(name: str, path: Path, kind: str, seed: int, ignore: list[str] | None = None):
    """Writes a compressed-tensors checkpoint of a random tiny model; returns the
    transformers model holding the library's dequantization of its weights."""
    return ct_write(tiny_hf(name, seed), path, kind, ignore)


def ct_write(hf, path: Path, kind: str, ignore: list[str] | None = None):
    """Writes transformers model ``hf`` as a compressed-tensors checkpoint of scheme
    ``kind`` (see ct_scheme; ``hf`` itself is compressed); returns a copy of the original
    model holding the library's dequantization of its weights."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    oracle = copy.deepcopy(hf)
    config = QuantizationConfig(config_groups={"group_0": ct_scheme(kind)},
                                ignore=["lm_head"] + (ignore or []))
    apply_quantization_config(hf, config, show_progress=False)
    for _, module in hf.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        args, w = scheme.weights, module.weight.detach()
        if args.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif args.strategy == "tensor":
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        else:
            grouped = w.view(w.shape[0], -1, args.group_size)
            lo, hi = grouped.amin(-1), grouped.amax(-1)
        scale, _ = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(hf)
    compressor.compress_model(hf)
    hf.save_pretrained(path)
    compressor.update_config(str(path))
    compressor.decompress_model(hf)
    names = {n for n, m in hf.named_modules() if getattr(m, "quantization_scheme", None)}
    with torch.no_grad():
        for n, m in oracle.named_modules():
            if n in names:
                m.weight.copy_(hf.get_submodule(n).weight.float())
    return oracle


def _pack_rows(q: np.ndarray) -> np.ndarray:
    """[R, C] values 0..15 -> [R / 8, C] words, row 8r + j in bits 4j of word r."""
    words = np.zeros((q.shape[0] // 8, q.shape[1]), dtype=np.uint32)
    for j in range(8):
        words |= q[j::8].astype(np.uint32) << np.uint32(4 * j)
    return words.view(np.int32)


def _pack_cols(q: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """[R, C] values 0..15 -> [R, C / 8] words, column 8c + order[j] in bits 4j of word c."""
    words = np.zeros((q.shape[0], q.shape[1] // 8), dtype=np.uint32)
    for j in range(8):
        words |= q[:, order[j]::8].astype(np.uint32) << np.uint32(4 * j)
    return words.view(np.int32)


def _asym_groups(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool):
    """Per (group, output column) scales (float16) and zeros (1..15) of w [out, in], and
    the quantized values q [in, out]."""
    wt = w.t()  # [in, out]
    scales = torch.empty(groups, w.shape[0])
    zeros = torch.empty(groups, w.shape[0], dtype=torch.int64)
    for gi in range(groups):
        rows = wt[g_idx == gi]
        if sym:
            scales[gi] = rows.abs().amax(0) / 7
            zeros[gi] = 8
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scales[gi] = (hi - lo) / 15
            zeros[gi] = (-lo / scales[gi]).round().clamp(1, 15).long()
    scales = scales.half()
    s, z = scales.float()[g_idx], zeros[g_idx]
    q = (wt / s).round().long().add(z).clamp(0, 15)
    deq = ((q - z).float() * s).t()
    return q, scales, zeros, deq


def gptq_tensors(w: torch.Tensor, group: int, sym: bool, order: torch.Tensor | None = None):
    """GPTQ tensors of w [out, in] and the dequantized weight. With an ``order`` (a
    permutation of the input rows: desc_act) the groups are scattered rows."""
    n = w.shape[1]
    groups = n // group
    g_idx = torch.arange(n) // group
    if order is not None:
        g_idx = g_idx[order]
    q, scales, zeros, deq = _asym_groups(w, g_idx, groups, sym)
    tensors = {
        "qweight": torch.from_numpy(_pack_rows(q.numpy())),
        "qzeros": torch.from_numpy(_pack_cols((zeros - 1).numpy())),
        "scales": scales,
        "g_idx": g_idx.int(),
    }
    return tensors, deq


def awq_tensors(w: torch.Tensor, group: int):
    """AWQ (GEMM) tensors of w [out, in] and the dequantized weight."""
    g_idx = torch.arange(w.shape[1]) // group
    q, scales, zeros, deq = _asym_groups(w, g_idx, w.shape[1] // group, sym=False)
    tensors = {
        "qweight": torch.from_numpy(_pack_cols(q.numpy(), AWQ_ORDER)),
        "qzeros": torch.from_numpy(_pack_cols(zeros.numpy(), AWQ_ORDER)),
        "scales": scales,
    }
    return tensors, deq


def packed_checkpoint(name: str, path: Path, fmt: str, seed: int, group: int = 32,
                      act_order: bool = False, sym: bool = True):
    """Writes a GPTQ (fmt 'gptq') or AWQ ('awq') checkpoint of a random tiny model;
    returns the transformers model with the dequantized weights."""
    hf = tiny_hf(name, seed)
    hf.save_pretrained(path)  # config.json and the full-precision tensors
    gen = torch.Generator().manual_seed(seed)
    # Projections of one input (q/k/v, gate/up) share GPTQ's activation order.
    orders: dict[str, torch.Tensor] = {}
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if getattr(hf.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    with torch.no_grad():
        for module_name, module in _quantized_linears(hf):
            w = state.pop(f"{module_name}.weight")
            if fmt == "gptq":
                parent, proj = module_name.rsplit(".", 1)
                key = parent if proj in ("q_proj", "k_proj", "v_proj", "gate_proj",
                                         "up_proj") else module_name
                if act_order and key not in orders:
                    orders[key] = torch.randperm(w.shape[1], generator=gen)
                tensors, deq = gptq_tensors(w, group, sym, orders.get(key))
            else:
                tensors, deq = awq_tensors(w, group)
            state.update({f"{module_name}.{k}": v for k, v in tensors.items()})
            module.weight.copy_(deq)
    for f in path.glob("*.safetensors*"):
        f.unlink()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    if fmt == "gptq":
        quant = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
                 "sym": sym, "checkpoint_format": "gptq"}
    else:
        quant = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                 "version": "gemm", "modules_to_not_convert": None}
    edit_config(path, lambda c: c.__setitem__("quantization_config", quant))
    return hf


def fp8_rows_oracle(name: str, path: Path, seed: int):
    """Writes a full-precision checkpoint; returns the transformers model whose projections
    hold per-row FP8 (e4m3) quantized-then-dequantized weights, as --quantization fp8 makes."""
    hf = tiny_hf(name, seed)
    hf.save_pretrained(path)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    with torch.no_grad():
        for _, module in _quantized_linears(hf):
            w = module.weight
            scale = w.abs().amax(1, keepdim=True) / fp8_max
            module.weight.copy_((w / scale).to(torch.float8_e4m3fn).float() * scale)
    return hf


def edit_config(path: Path, edit) -> None:
    """Applies ``edit`` to the dict of path/config.json and writes it back."""
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    edit(config)
    config_file.write_text(json.dumps(config))


def checkpoint_bytes(path: Path) -> int:
    """Bytes of every tensor in path/model.safetensors."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            total += t.numel() * t.element_size()
    return total


def fp8_moe_checkpoint(path: Path, seed: int, oracle_dir: Path):
    """Writes a compressed-tensors FP8 (per-channel) tiny Qwen3-MoE checkpoint whose experts
    are quantized too; returns transformers' model of the dequantized weights (saved at
    oracle_dir and loaded back, so transformers stacks the experts itself).

    compressed-tensors quantizes only nn.Linear modules and transformers holds the experts
    as stacked tensors, so the tensors are written here by the format's rules: an
    float8_e4m3fn ``weight`` and a float32 ``weight_scale`` [out, 1] per projection."""
    import re

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tiny_hf("qwen3_moe", seed).save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    dequantized = dict(tensors)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    pattern = re.compile(r".*\.(q|k|v|o|gate|up|down)_proj\.weight$")
    for key in [k for k in tensors if pattern.match(k)]:
        w = tensors[key]
        scale = w.abs().amax(1, keepdim=True) / fp8_max
        q = (w / scale).to(torch.float8_e4m3fn)
        tensors[key], tensors[key + "_scale"] = q, scale
        dequantized[key] = q.float() * scale
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(path, oracle_dir)
    save_file(dequantized, oracle_dir / "model.safetensors", metadata={"format": "pt"})
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    edit_config(path, lambda c: c.__setitem__("quantization_config", {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": acts}},
        "ignore": ["lm_head", "re:.*mlp\\.gate$"]}))
    return AutoModelForCausalLM.from_pretrained(oracle_dir, dtype=torch.float32,
                                                attn_implementation="eager").eval()
