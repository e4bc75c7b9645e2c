"""CPU ops that build the model runner's flat varlen inputs, native when possible.

The native versions live in csrc/cpu/prepare_inputs.cpp, built by setup.py into vllm/_C<suffix>
and loaded here with ctypes on the first call of a public op (not at import). Without that
library, or with VLLM_DISABLE_NATIVE=1 at that moment, the public functions run numpy
implementations with the same results and the same errors: each public op checks its arguments
once, then runs one implementation. The choice is made once per process, for every op together
(`_ops`); HAS_NATIVE reports it.

Two ops have no numpy twin: paged_decode_attention (csrc/cpu/paged_attention.cpp), the CPU
decode attention, whose fallback is the torch backend's own tiled decode, and dense_rows
(csrc/cpu/dense_rows.cpp), the LM head's few-row product, whose fallback is the BLAS with
padded rows (model_executor/layers/batch_invariant_linear.py). The per-layer ops of
csrc/cpu/layer_ops.cpp are declared here and called by model_executor/layers/layer_ops.py,
whose fallback is the layers' own torch code.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# Must equal kAbiVersion in csrc/cpu/prepare_inputs.cpp; a library with another version is stale.
ABI_VERSION = 6

_STATUS_MESSAGES = {
    1: "req_indices: a request index is outside the block table's rows",
    2: "positions: a position is negative or past the last block of its block table row",
    3: "block_size: must be positive",
    4: "num_scheduled/num_computed_tokens: counts must not be negative",
    5: "out_req_indices/out_positions: length must equal the sum of num_scheduled",
    6: "logit_rows/mask_rows: a row index is outside its array",
    7: "rows/table_rows/seq_lens: a row is out of range, a context length is not in "
       "1..(block table columns * block size), or a block id it uses is outside the cache",
    8: "kv_cache/query: a size is not positive or the query heads are not a multiple of the "
       "KV heads",
    9: "x/w/out: a size or the chunk is not positive",
    10: "layer op: a size is not positive (or the head size is odd)",
    11: "positions: a position is outside the RoPE tables",
    12: "slot_mapping: a slot is outside the KV cache",
}

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_F32 = ctypes.c_float
_I32 = ctypes.c_int32
_LAYER_OPS = {
    "vllm_rms_norm": [_P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _F32, _P, _I64, _I32],
    "vllm_rotary_neox": [_P, _I64, _P, _P, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _P, _I64,
                         _P, _I64],
    "vllm_silu_and_mul": [_P, _I64, _I64, _I64, _P, _I64, _I32],
    "vllm_write_kv": [_P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64],
}


def find_library(package_dir: Path | None = None) -> Path | None:
    """Returns the path of the built _C library in package_dir (default: this package), or None."""
    directory = package_dir if package_dir is not None else Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = directory / f"_C{suffix}"
        if candidate.is_file():
            return candidate
    return None


def load_library(path: Path) -> ctypes.CDLL | None:
    """Loads the native library at path and declares its signatures.

    Returns None (with a RuntimeWarning) when the file cannot be loaded, lacks a symbol, or was
    built for another ABI_VERSION, so a broken build degrades to the numpy fallbacks.
    """
    try:
        lib = ctypes.CDLL(str(path))
        lib.vllm_native_abi_version.restype = ctypes.c_int32
        lib.vllm_native_abi_version.argtypes = []
        version = lib.vllm_native_abi_version()
        if version != ABI_VERSION:
            raise OSError(f"ABI version {version}, expected {ABI_VERSION} (stale build?)")
        lib.vllm_compute_slot_mapping.restype = ctypes.c_int32
        lib.vllm_compute_slot_mapping.argtypes = [_P, _I64, _I64, _P, _P, _I64, _I64, _P]
        lib.vllm_prepare_positions.restype = ctypes.c_int32
        lib.vllm_prepare_positions.argtypes = [_P, _P, _I64, _P, _P, _I64]
        lib.vllm_apply_token_bitmask.restype = ctypes.c_int32
        lib.vllm_apply_token_bitmask.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _I64, _P, _P, _I64]
        lib.vllm_masked_argmax.restype = ctypes.c_int32
        lib.vllm_masked_argmax.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _I64, _P, _P]
        lib.vllm_paged_decode_attention.restype = ctypes.c_int32
        lib.vllm_paged_decode_attention.argtypes = [
            _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64, _P, _I64, _I64, _I64, _P, _P, _P,
            _I64, ctypes.c_float, _P, _I64, ctypes.c_int32,
        ]
        lib.vllm_dense_rows.restype = ctypes.c_int32
        lib.vllm_dense_rows.argtypes = [
            _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _P, _I64, ctypes.c_int32,
        ]
        # The per-layer ops of layers/layer_ops.py (csrc/cpu/layer_ops.cpp).
        for name, argtypes in _LAYER_OPS.items():
            getattr(lib, name).restype = ctypes.c_int32
            getattr(lib, name).argtypes = argtypes
    except (OSError, AttributeError) as exc:
        warnings.warn(f"ignoring native library {path}: {exc}", RuntimeWarning, stacklevel=2)
        return None
    return lib


def native_disabled() -> bool:
    """Returns True when the environment asks for the numpy fallbacks (VLLM_DISABLE_NATIVE=1)."""
    return os.environ.get("VLLM_DISABLE_NATIVE", "0").strip().lower() in ("1", "true", "yes")


_load_lock = threading.Lock()
# Set together, once, by _library(); _LIB stays None when the numpy versions are used.
_LIB: ctypes.CDLL | None = None
_LIB_RESOLVED = False


def _library() -> ctypes.CDLL | None:
    """The native library, loaded on the first call (None: use numpy); the same ever after."""
    global _LIB, _LIB_RESOLVED
    if not _LIB_RESOLVED:
        # The engine thread and the worker thread may both make the first call.
        with _load_lock:
            if not _LIB_RESOLVED:
                path = None if native_disabled() else find_library()
                _LIB = load_library(path) if path is not None else None
                _LIB_RESOLVED = True
    return _LIB


def _require_library() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("vllm native library is not loaded (HAS_NATIVE is False)")
    return lib


def _check(name: str, array: object, dtype: type, ndim: int, writeable: bool = False) -> np.ndarray:
    """Returns array if a C-contiguous numpy array of dtype and ndim, else raises ValueError."""
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(array).__name__}")
    if array.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {np.dtype(dtype)}, got {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimension(s), got shape {array.shape}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    if writeable and not array.flags.writeable:
        raise ValueError(f"{name}: must be writeable")
    return array


def _raise_status(status: int) -> None:
    if status != 0:
        raise ValueError(_STATUS_MESSAGES.get(status, f"native op failed with status {status}"))


def _call_native(symbol: str, *args: int) -> None:
    """Calls the library's function symbol and raises the ValueError for a failing status."""
    _raise_status(getattr(_require_library(), symbol)(*args))


def _same_length(name: str, array: np.ndarray, other_name: str, other: np.ndarray) -> None:
    """Raises ValueError naming array unless it is as long as other."""
    if array.shape[0] != other.shape[0]:
        raise ValueError(f"{name}: length {array.shape[0]} != len({other_name}) {other.shape[0]}")


def compute_slot_mapping(
    block_table: np.ndarray,
    req_indices: np.ndarray,
    positions: np.ndarray,
    block_size: int,
    out: np.ndarray,
) -> None:
    """Writes the KV-cache slot of every flat token into out.

    out[i] = block_table[req_indices[i], positions[i] // block_size] * block_size
             + positions[i] % block_size.
    block_table: int32 [num_rows, blocks_per_row], C-contiguous; req_indices: int32 [T];
    positions: int64 [T]; out: int64 [T], writeable. Uses the native library when HAS_NATIVE.
    Raises ValueError for a wrong dtype, shape, or contiguity, a non-positive block_size, a request
    index outside the table, or a negative position or one past its row's last block; out is
    untouched then.
    """
    # Chosen before the checks, so that even a rejected first call fixes native vs numpy.
    impl = _ops()
    _check("block_table", block_table, np.int32, 2)
    _check("req_indices", req_indices, np.int32, 1)
    _check("positions", positions, np.int64, 1)
    _check("out", out, np.int64, 1, writeable=True)
    _same_length("positions", positions, "req_indices", req_indices)
    _same_length("out", out, "req_indices", req_indices)
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise ValueError(f"block_size: expected an int, got {type(block_size).__name__}")
    if block_size <= 0:
        raise ValueError(f"block_size: must be positive, got {block_size}")
    impl.compute_slot_mapping(block_table, req_indices, positions, block_size, out)


def _slot_mapping_numpy(
    block_table: np.ndarray,
    req_indices: np.ndarray,
    positions: np.ndarray,
    block_size: int,
    out: np.ndarray,
) -> None:
    """compute_slot_mapping's numpy implementation, on arguments it has checked."""
    if req_indices.shape[0] == 0:
        return
    num_rows, num_cols = block_table.shape
    if req_indices.min() < 0 or req_indices.max() >= num_rows:
        _raise_status(1)
    if positions.min() < 0 or positions.max() >= num_cols * block_size:
        _raise_status(2)
    blocks = positions // block_size
    # int64 before multiplying: block id * block_size can exceed int32.
    np.multiply(block_table[req_indices, blocks], block_size, out=out, dtype=np.int64)
    out += positions - blocks * block_size


def _slot_mapping_native(
    block_table: np.ndarray,
    req_indices: np.ndarray,
    positions: np.ndarray,
    block_size: int,
    out: np.ndarray,
) -> None:
    """compute_slot_mapping's native implementation, on arguments it has checked."""
    _call_native(
        "vllm_compute_slot_mapping",
        block_table.ctypes.data,
        block_table.shape[0],
        block_table.shape[1],
        req_indices.ctypes.data,
        positions.ctypes.data,
        req_indices.shape[0],
        int(block_size),
        out.ctypes.data,
    )


def prepare_positions(
    num_computed_tokens: np.ndarray,
    num_scheduled: np.ndarray,
    out_req_indices: np.ndarray,
    out_positions: np.ndarray,
) -> None:
    """Expands per-request token ranges into flat per-token request indices and positions.

    Request r contributes tokens num_computed_tokens[r] .. num_computed_tokens[r] +
    num_scheduled[r] - 1, in request order: out_req_indices gets r and out_positions the token
    position. num_computed_tokens, num_scheduled: int32 [R]; out_req_indices: int32 [T];
    out_positions: int64 [T], where T must equal sum(num_scheduled). Uses the native library when
    HAS_NATIVE. Raises ValueError for a wrong dtype, shape, or contiguity, a negative count or
    start, or T != sum(num_scheduled); the outputs are untouched then.
    """
    impl = _ops()
    _check("num_computed_tokens", num_computed_tokens, np.int32, 1)
    _check("num_scheduled", num_scheduled, np.int32, 1)
    _check("out_req_indices", out_req_indices, np.int32, 1, writeable=True)
    _check("out_positions", out_positions, np.int64, 1, writeable=True)
    _same_length("num_scheduled", num_scheduled, "num_computed_tokens", num_computed_tokens)
    _same_length("out_positions", out_positions, "out_req_indices", out_req_indices)
    impl.prepare_positions(num_computed_tokens, num_scheduled, out_req_indices, out_positions)


def _positions_numpy(
    num_computed_tokens: np.ndarray,
    num_scheduled: np.ndarray,
    out_req_indices: np.ndarray,
    out_positions: np.ndarray,
) -> None:
    """prepare_positions' numpy implementation, on arguments it has checked."""
    num_reqs = num_scheduled.shape[0]
    if num_reqs and (num_scheduled.min() < 0 or num_computed_tokens.min() < 0):
        _raise_status(4)
    counts = num_scheduled.astype(np.int64)
    if int(counts.sum()) != out_positions.shape[0]:
        _raise_status(5)
    req_ids = np.repeat(np.arange(num_reqs, dtype=np.int32), counts)
    out_req_indices[:] = req_ids
    # Position of flat token t of request r: num_computed[r] + (t - first flat index of r).
    first = np.cumsum(counts) - counts
    offsets = (num_computed_tokens.astype(np.int64) - first)[req_ids]
    np.add(np.arange(out_positions.shape[0], dtype=np.int64), offsets, out=out_positions)


def _positions_native(
    num_computed_tokens: np.ndarray,
    num_scheduled: np.ndarray,
    out_req_indices: np.ndarray,
    out_positions: np.ndarray,
) -> None:
    """prepare_positions' native implementation, on arguments it has checked."""
    _call_native(
        "vllm_prepare_positions",
        num_computed_tokens.ctypes.data,
        num_scheduled.ctypes.data,
        num_scheduled.shape[0],
        out_req_indices.ctypes.data,
        out_positions.ctypes.data,
        out_positions.shape[0],
    )


def apply_token_bitmask(
    logits: np.ndarray, bitmask: np.ndarray, logit_rows: np.ndarray, mask_rows: np.ndarray
) -> None:
    """Sets logits[logit_rows[i], t] = -inf for every token t that bitmask[mask_rows[i]] forbids.

    logits: float32 [R, V], writeable (e.g. a CPU tensor's .numpy() view); bitmask: int32
    [M, ceil(V / 32)], bit j of word w allowing token 32 * w + j; logit_rows, mask_rows: int64
    [N]. Uses the native library when HAS_NATIVE. Raises ValueError for a wrong dtype, shape or
    contiguity, or a row index out of range; logits are untouched then.
    """
    impl = _ops()
    _check("logits", logits, np.float32, 2, writeable=True)
    _check("bitmask", bitmask, np.int32, 2)
    _check("logit_rows", logit_rows, np.int64, 1)
    _check("mask_rows", mask_rows, np.int64, 1)
    _same_length("mask_rows", mask_rows, "logit_rows", logit_rows)
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(
            f"bitmask: {bitmask.shape[1]} words per row cannot mask {logits.shape[1]} tokens"
        )
    impl.apply_token_bitmask(logits, bitmask, logit_rows, mask_rows)


def _bitmask_numpy(
    logits: np.ndarray, bitmask: np.ndarray, logit_rows: np.ndarray, mask_rows: np.ndarray
) -> None:
    """apply_token_bitmask's numpy implementation, on arguments it has checked."""
    if logit_rows.shape[0] == 0:
        return
    if not (0 <= logit_rows.min() and logit_rows.max() < logits.shape[0]):
        _raise_status(6)
    if not (0 <= mask_rows.min() and mask_rows.max() < bitmask.shape[0]):
        _raise_status(6)
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask[mask_rows].view(np.uint8), axis=1, bitorder="little")
    allowed = bits[:, :vocab].astype(bool)
    rows = logits[logit_rows]
    rows[~allowed] = -np.inf
    logits[logit_rows] = rows


def _bitmask_native(
    logits: np.ndarray, bitmask: np.ndarray, logit_rows: np.ndarray, mask_rows: np.ndarray
) -> None:
    """apply_token_bitmask's native implementation, on arguments it has checked."""
    _call_native(
        "vllm_apply_token_bitmask",
        logits.ctypes.data,
        logits.shape[0],
        logits.shape[1],
        logits.shape[1],
        bitmask.ctypes.data,
        bitmask.shape[0],
        bitmask.shape[1],
        logit_rows.ctypes.data,
        mask_rows.ctypes.data,
        logit_rows.shape[0],
    )


def masked_argmax(
    logits: np.ndarray, bitmask: np.ndarray | None, mask_rows: np.ndarray | None, out: np.ndarray
) -> None:
    """Writes into out[r] the argmax of logits row r, reading each row once.

    Where mask_rows[r] >= 0, the tokens that bitmask[mask_rows[r]] forbids count as -inf (the
    logits are not written); mask_rows[r] < 0, or mask_rows None, means no mask. Ties and NaN
    follow torch.argmax: the first largest value, else the first NaN; an all -inf row gives 0.
    logits: float32 [R, V] (rows may be strided, columns contiguous); bitmask: int32
    [M, ceil(V / 32)] or None; mask_rows: int64 [R] or None; out: int64 [R], writeable. Uses the
    native library when HAS_NATIVE. Raises ValueError for a wrong dtype, shape or layout, or a
    mask row out of range; out is untouched then.
    """
    impl = _ops()
    if not isinstance(logits, np.ndarray) or logits.dtype != np.float32 or logits.ndim != 2:
        raise ValueError("logits: expected a float32 numpy array with 2 dimensions")
    if logits.strides[1] != 4 or logits.strides[0] % 4 or logits.strides[0] < 4 * logits.shape[1]:
        raise ValueError("logits: rows must have contiguous, non-overlapping columns")
    _check("out", out, np.int64, 1, writeable=True)
    if out.shape[0] != logits.shape[0]:
        raise ValueError(f"out: length {out.shape[0]} != logits rows {logits.shape[0]}")
    if mask_rows is not None:
        _check("mask_rows", mask_rows, np.int64, 1)
        if mask_rows.shape[0] != logits.shape[0]:
            raise ValueError(f"mask_rows: length {mask_rows.shape[0]} != logits rows "
                             f"{logits.shape[0]}")
        if bitmask is None:
            raise ValueError("bitmask: required when mask_rows is given")
        _check("bitmask", bitmask, np.int32, 2)
        if bitmask.shape[1] * 32 < logits.shape[1]:
            raise ValueError(
                f"bitmask: {bitmask.shape[1]} words per row cannot mask {logits.shape[1]} tokens"
            )
    impl.masked_argmax(logits, bitmask, mask_rows, out)


def _argmax_numpy(
    logits: np.ndarray, bitmask: np.ndarray | None, mask_rows: np.ndarray | None, out: np.ndarray
) -> None:
    """masked_argmax's numpy implementation, on arguments it has checked."""
    masked = [] if mask_rows is None else np.flatnonzero(mask_rows >= 0)
    if len(masked) and mask_rows[masked].max() >= bitmask.shape[0]:
        _raise_status(6)
    result = np.argmax(logits, axis=1) if logits.shape[1] else np.zeros(len(out), np.int64)
    vocab = logits.shape[1]
    for r in masked:
        bits = np.unpackbits(bitmask[mask_rows[r]].view(np.uint8), bitorder="little")
        result[r] = np.argmax(np.where(bits[:vocab].astype(bool), logits[r], -np.inf))
    out[:] = result


def _argmax_native(
    logits: np.ndarray, bitmask: np.ndarray | None, mask_rows: np.ndarray | None, out: np.ndarray
) -> None:
    """masked_argmax's native implementation, on arguments it has checked."""
    _call_native(
        "vllm_masked_argmax",
        logits.ctypes.data,
        logits.shape[0],
        logits.strides[0] // 4,
        logits.shape[1],
        None if bitmask is None else bitmask.ctypes.data,
        0 if bitmask is None else bitmask.shape[0],
        0 if bitmask is None else bitmask.shape[1],
        None if mask_rows is None else mask_rows.ctypes.data,
        out.ctypes.data,
    )


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    table_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_threads: int,
) -> None:
    """Writes into out[rows[i]] the attention of query[rows[i]] over the paged cache.

    Decode i has one query row, rows[i], which sits at position seq_lens[i] - 1 of the
    request whose blocks are block_table[table_rows[i]]; it attends to positions
    0..seq_lens[i] - 1 (softmax of scale * q.k, grouped-query heads). Each request's result is
    the same in any batch and for any num_threads (<= 0: the OpenMP default). Other rows of
    out are not written. query, out: float32 CPU [T, num_heads, head_size], heads and head
    size contiguous; kv_cache: float32 CPU [2, num_blocks, block_size, kv_heads, head_size],
    contiguous; block_table: int32 [R, C], columns contiguous; rows, table_rows, seq_lens:
    int64 [N], contiguous. Native only: raises RuntimeError without the library (see
    HAS_NATIVE; the torch backend then uses its own tiled decode), ValueError naming the
    argument for a wrong dtype, device, shape or layout, an out-of-range row or context
    length, or a block id outside the cache; out is untouched then.
    """
    import torch

    lib = _require_library()
    # Checked with the cheapest attribute reads there are: every layer of a decode step
    # calls this (is_cpu and `dtype is` cost a fifth of device.type and `dtype ==`).
    for name, t, dtype, ndim in (("query", query, torch.float32, 3),
                                 ("out", out, torch.float32, 3),
                                 ("kv_cache", kv_cache, torch.float32, 5),
                                 ("block_table", block_table, torch.int32, 2),
                                 ("rows", rows, torch.int64, 1),
                                 ("table_rows", table_rows, torch.int64, 1),
                                 ("seq_lens", seq_lens, torch.int64, 1)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch tensor, got {type(t).__name__}")
        if t.dtype is not dtype or not t.is_cpu or t.dim() != ndim:
            raise ValueError(f"{name}: expected a {dtype} CPU tensor with {ndim} dimensions, "
                             f"got {t.dtype} on {t.device} with shape {tuple(t.shape)}")
        if ndim == 1:
            if not t.is_contiguous():
                raise ValueError(f"{name}: must be contiguous")
            if t.shape[0] != rows.shape[0]:
                raise ValueError(f"{name}: length {t.shape[0]} != len(rows) {rows.shape[0]}")
    if not kv_cache.is_contiguous() or kv_cache.shape[0] != 2:
        raise ValueError("kv_cache: must be contiguous with a first dimension of 2 (keys, values)")
    _, num_blocks, block_size, kv_heads, head_size = kv_cache.shape
    num_heads = query.shape[1]
    for name, t in (("query", query), ("out", out)):
        stride = t.stride()
        if (t.shape[1] != num_heads or t.shape[2] != head_size or stride[2] != 1
                or stride[1] != head_size):
            raise ValueError(f"{name}: expected rows of [{num_heads}, {head_size}] contiguous "
                             f"values, got shape {tuple(t.shape)} strides {stride}")
    if out.shape[0] != query.shape[0]:
        raise ValueError(f"out: {out.shape[0]} rows != query rows {query.shape[0]}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table: columns must be contiguous")
    _raise_status(lib.vllm_paged_decode_attention(
        query.data_ptr(), query.shape[0], query.stride(0), kv_cache.data_ptr(), num_blocks,
        block_size, kv_heads, head_size, num_heads, block_table.data_ptr(),
        block_table.shape[0], block_table.shape[1], block_table.stride(0), rows.data_ptr(),
        table_rows.data_ptr(), seq_lens.data_ptr(), rows.shape[0], float(scale),
        out.data_ptr(), out.stride(0), int(num_threads),
    ))


def dense_rows(x: torch.Tensor, w: torch.Tensor, chunk: int, out: torch.Tensor,
               num_threads: int = 0) -> torch.Tensor:
    """Writes x @ w into out and returns out, each element summed in one fixed order: the
    inner dimension in chunks of `chunk` terms, each a fused multiply-add chain from zero,
    the chunks' sums added left to right. A row's numbers therefore do not depend on the
    other rows of the call. x: float32 CPU [M, K]; w: float32 CPU [K, N]; out: float32 CPU
    [M, N]; each with contiguous rows; num_threads <= 0: the OpenMP default. Native only:
    raises RuntimeError without the library (see HAS_NATIVE), ValueError naming the argument
    for a wrong dtype, device, shape or layout or a chunk that is not positive; out is
    untouched then.
    """
    import torch

    lib = _require_library()
    # The cheapest attribute reads (see paged_decode_attention): every dense layer of a
    # decode step of up to 16 rows calls this.
    for name, t in (("x", x), ("w", w), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch tensor, got {type(t).__name__}")
        if t.dtype is not torch.float32 or not t.is_cpu or t.dim() != 2:
            raise ValueError(f"{name}: expected a float32 CPU matrix, got {t.dtype} on "
                             f"{t.device} with shape {tuple(t.shape)}")
        stride = t.stride()
        if stride[1] != 1 or stride[0] < t.shape[1]:
            raise ValueError(f"{name}: rows must be contiguous, got strides {stride}")
    if x.shape[1] != w.shape[0] or out.shape[0] != x.shape[0] or out.shape[1] != w.shape[1]:
        raise ValueError(f"x/w/out: shapes {tuple(x.shape)} @ {tuple(w.shape)} -> "
                         f"{tuple(out.shape)} do not match")
    if chunk <= 0:
        raise ValueError(f"chunk: must be positive, got {chunk}")
    if x.numel() and w.numel():
        _raise_status(lib.vllm_dense_rows(
            x.data_ptr(), x.shape[0], x.stride(0), w.data_ptr(), w.shape[0], w.shape[1],
            w.stride(0), int(chunk), out.data_ptr(), out.stride(0), int(num_threads),
        ))
    else:
        out.zero_()
    return out


SlotMappingFn = Callable[[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray], None]
PreparePositionsFn = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]
TokenBitmaskFn = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]
ArgmaxFn = Callable[[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray], None]


@dataclass(frozen=True)
class _OpTable:
    """One implementation of every op, all native or all numpy; the public ops check first."""

    compute_slot_mapping: SlotMappingFn
    prepare_positions: PreparePositionsFn
    apply_token_bitmask: TokenBitmaskFn
    masked_argmax: ArgmaxFn


_NATIVE_OPS = _OpTable(
    _slot_mapping_native, _positions_native, _bitmask_native, _argmax_native
)
_NUMPY_OPS = _OpTable(_slot_mapping_numpy, _positions_numpy, _bitmask_numpy, _argmax_numpy)


def _ops() -> _OpTable:
    """The implementations the public ops use: the one place native vs numpy is decided."""
    return _NATIVE_OPS if _library() is not None else _NUMPY_OPS


if TYPE_CHECKING:
    # True when the ops run natively. Computed on access (below), since a plain module
    # attribute would have to load the library at import.
    HAS_NATIVE: bool


def __getattr__(name: str) -> bool:
    if name == "HAS_NATIVE":
        return _ops() is _NATIVE_OPS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
