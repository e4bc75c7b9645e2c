"""Native CPU versions of a decoder layer's small ops (csrc/cpu/layer_ops.cpp).

RMSNorm with its residual add, neox RoPE from the cos/sin tables, SiLU-and-multiply and the
KV-cache write each take one native call instead of five to fifteen torch operations, whose
dispatch cost more than their arithmetic at decode batch shapes (docs/architecture.md §6).
Each function runs natively only on float32 CPU tensors laid out as rows of contiguous
values, without autograd, and with the native library loaded; otherwise it returns None
(write_kv: False) and the caller runs its torch version. A row's result never depends on the
other rows or the thread count, so batch invariance holds as with torch.
"""

from __future__ import annotations

import torch

from vllm import _custom_ops


_F32 = torch.float32

# Written in the plainest torch calls that do the job: at one token a layer makes about ten of
# these calls, and each attribute read or shape tuple costs a fraction of a microsecond
# (torch.empty with a torch.Size took twice as long as with ints).


def _rows(t: torch.Tensor) -> tuple[int, int] | None:
    """(rows, row stride) of t seen as rows of its last dimension, or None when they are not
    contiguous values at one stride."""
    if t.dim() == 2:
        stride = t.stride()
        return (t.shape[0], stride[0]) if stride[1] == 1 else None
    if t.is_contiguous() and t.dim():
        width = t.shape[-1]
        return (t.numel() // width if width else 0), width
    return None


def _eligible(t: torch.Tensor, grad: bool) -> bool:
    """A float32 CPU tensor that autograd does not track (`grad`: torch.is_grad_enabled())."""
    return t.dtype is _F32 and t.is_cpu and not (grad and t.requires_grad)


def _raise(status: int) -> None:
    if status:
        _custom_ops._raise_status(status)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """weight * RMSNorm over the last dimension of x, or, given a residual of x's shape,
    (that of x + residual, x + residual): new contiguous tensors. None when the native kernel
    cannot take these tensors."""
    lib = _custom_ops._library()
    if lib is None:
        return None
    grad = torch.is_grad_enabled()
    layout = _rows(x)
    if (layout is None or not _eligible(x, grad) or not _eligible(weight, grad)
            or (residual is not None and not _eligible(residual, grad))):
        return None
    rows, stride = layout
    hidden = x.shape[-1]
    if rows == 0 or hidden == 0 or weight.dim() != 1 or weight.shape[0] != hidden:
        return None
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if residual is None:
        _raise(lib.vllm_rms_norm(x.data_ptr(), stride, None, 0, None, 0, weight.data_ptr(),
                                 rows, hidden, eps, out.data_ptr(), hidden,
                                 torch.get_num_threads()))
        return out
    res_layout = _rows(residual)
    if res_layout is None or residual.shape != x.shape:
        return None
    summed = torch.empty_like(out)
    _raise(lib.vllm_rms_norm(x.data_ptr(), stride, residual.data_ptr(), res_layout[1],
                             summed.data_ptr(), hidden, weight.data_ptr(), rows, hidden, eps,
                             out.data_ptr(), hidden, torch.get_num_threads()))
    return out, summed


def rotary_neox(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                cos_table: torch.Tensor, sin_table: torch.Tensor, head_size: int
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Neox RoPE of query [T, H * D] and key [T, Hkv * D] at int64 positions [T], from
    float32 tables [max_position, D / 2]: new contiguous tensors, the same numbers as
    RotaryEmbedding's torch version. None when the native kernel cannot take these tensors.
    Raises ValueError for a position outside the tables."""
    lib = _custom_ops._library()
    if lib is None or query.dim() != 2 or key.dim() != 2 or positions.dim() != 1:
        return None
    grad = torch.is_grad_enabled()
    q_stride, k_stride = query.stride(), key.stride()
    tokens = query.shape[0]
    if (q_stride[1] != 1 or k_stride[1] != 1 or positions.dtype is not torch.int64
            or not positions.is_cpu or not positions.is_contiguous()
            or positions.shape[0] != tokens or key.shape[0] != tokens
            or not _eligible(query, grad) or not _eligible(key, grad)
            or not _eligible(cos_table, grad) or not _eligible(sin_table, grad)):
        return None
    q_width, k_width = query.shape[1], key.shape[1]
    q_out = torch.empty(tokens, q_width, dtype=_F32)
    k_out = torch.empty(tokens, k_width, dtype=_F32)
    if tokens:
        _raise(lib.vllm_rotary_neox(
            positions.data_ptr(), tokens, cos_table.data_ptr(), sin_table.data_ptr(),
            cos_table.shape[0], head_size, query.data_ptr(), q_stride[0], q_width // head_size,
            key.data_ptr(), k_stride[0], k_width // head_size, q_out.data_ptr(), q_width,
            k_out.data_ptr(), k_width))
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of x [..., 2 * d] = [gate | up]: a new contiguous [..., d]. None when
    the native kernel cannot take x."""
    lib = _custom_ops._library()
    if lib is None or not _eligible(x, torch.is_grad_enabled()):
        return None
    layout = _rows(x)
    if layout is None or layout[0] == 0 or x.shape[-1] % 2:
        return None
    rows, stride = layout
    width = x.shape[-1] // 2
    out = torch.empty(rows, width, dtype=_F32)
    _raise(lib.vllm_silu_and_mul(x.data_ptr(), stride, rows, width, out.data_ptr(), width,
                                 torch.get_num_threads()))
    return out if x.dim() == 2 else out.view(*x.shape[:-1], width)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """Copies key/value [N, Hkv, D] to the flat slots of a float32 [2, blocks, block_size,
    Hkv, D] cache (slot -1: skipped) and returns True; False (nothing written) when the
    native kernel cannot take these tensors. Raises ValueError for a slot outside the cache."""
    lib = _custom_ops._library()
    if lib is None or key.dim() != 3 or kv_cache.dim() != 5 or slot_mapping.dim() != 1:
        return False
    grad = torch.is_grad_enabled()
    cache_shape, key_shape = kv_cache.shape, key.shape
    heads, size = key_shape[1], key_shape[2]
    k_stride, v_stride = key.stride(), value.stride()
    if (value.shape != key_shape or cache_shape[0] != 2 or cache_shape[3] != heads
            or cache_shape[4] != size or k_stride[2] != 1 or k_stride[1] != size
            or v_stride[2] != 1 or v_stride[1] != size or not kv_cache.is_contiguous()
            or slot_mapping.dtype is not torch.int64 or not slot_mapping.is_cpu
            or not slot_mapping.is_contiguous() or slot_mapping.shape[0] != key_shape[0]
            or not _eligible(key, grad) or not _eligible(value, grad)
            or not _eligible(kv_cache, grad)):
        return False
    _raise(lib.vllm_write_kv(
        key.data_ptr(), k_stride[0], value.data_ptr(), v_stride[0], slot_mapping.data_ptr(),
        key_shape[0], kv_cache.data_ptr(), cache_shape[1] * cache_shape[2], heads * size))
    return True
