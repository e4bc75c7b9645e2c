"""Persistent device buffers of a step's sampling parameters and grammar bitmask.

The post-layer function (post_layer.py) reads every row's temperature, top-k, top-p, min-p,
noise key, row of the request tables (request_slots.py) and bitmask from fixed device
addresses, so a CUDA graph can replay it. They live in one device byte buffer, and each step
fills it with ONE host-to-device copy from pinned memory: the parameter sections whole (a
few bytes per row) and, when a row is constrained, the bitmask rows of the padded batch.
Two pinned host sets alternate, and a set is only rewritten once the copy that read it has
finished, so the host never waits for the device and never overwrites memory a copy still
reads.

On CUDA the copy runs on a side stream: it may overlap the forward pass queued before it, but
not the previous step's post-layer work, which still reads the buffer (it waits for that).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.v1.sample.ops.dense_sampling import DenseRows

# name -> (numpy dtype, trailing shape). Widest first, so every section stays aligned.
_PARAMS = {
    "keys": (np.int64, (2,)),
    "top_k": (np.int64, ()),
    "table_rows": (np.int64, ()),
    "temperature": (np.float32, ()),
    "top_p": (np.float32, ()),
    "min_p": (np.float32, ()),
}
# What each parameter holds on a row no request uses (padding): a greedy row, no filters, and
# the request tables' spare slot (no edit), whose row is 2 max_rows.
_OFF = {"keys": 0, "top_k": 0, "temperature": 0.0, "top_p": 1.0, "min_p": 0.0}


class SamplingBuffers:
    """The device buffers (see module docstring) for up to `max_rows` rows of a
    `vocab_size` vocabulary."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        if max_rows < 1 or vocab_size < 1:
            raise ValueError(f"max_rows, vocab_size: must be positive, got {max_rows}, "
                             f"{vocab_size}")
        self.max_rows = max_rows
        self._off = dict(_OFF, table_rows=2 * max_rows)
        self.words = (vocab_size + 31) // 32
        self.device = device
        self._sections: dict[str, tuple[int, np.dtype, tuple[int, ...]]] = {}
        offset = 0
        for name, (dtype, tail) in _PARAMS.items():
            shape = (max_rows, *tail)
            self._sections[name] = (offset, np.dtype(dtype), shape)
            offset += int(np.prod(shape)) * np.dtype(dtype).itemsize
        self.params_bytes = offset
        self._sections["bitmask"] = (offset, np.dtype(np.int32), (max_rows, self.words))
        total = offset + max_rows * self.words * 4
        cuda = device.type == "cuda"
        self.device_bytes = torch.empty(total, dtype=torch.uint8, device=device)
        self._host = [torch.empty(total, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self._turn = 0
        self._copied = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None
        self._stream = torch.cuda.Stream() if cuda else None
        # Recorded after each use of the buffers on the compute stream (mark_read).
        self._read = torch.cuda.Event() if cuda else None
        self._uploaded = torch.cuda.Event() if cuda else None
        self.stage(None, [], 0)  # every row 'off' and unconstrained until the first step

    def _view(self, data: torch.Tensor | np.ndarray, name: str):
        offset, dtype, shape = self._sections[name]
        size = int(np.prod(shape)) * dtype.itemsize
        part = data[offset : offset + size]
        if isinstance(part, np.ndarray):
            return part.view(dtype).reshape(shape)
        return part.view(_TORCH[dtype.name]).view(shape)

    def rows(self, n: int) -> DenseRows:
        """Device views of the first n rows' parameters (fixed addresses)."""
        b = self.device_bytes
        return DenseRows(
            temperature=self._view(b, "temperature")[:n],
            top_k=self._view(b, "top_k")[:n],
            top_p=self._view(b, "top_p")[:n],
            min_p=self._view(b, "min_p")[:n],
            keys=self._view(b, "keys")[:n],
        )

    def table_rows(self, n: int) -> torch.Tensor:
        """A device view of the first n rows' rows in the request tables (int64)."""
        return self._view(self.device_bytes, "table_rows")[:n]

    def bitmask(self, n: int) -> torch.Tensor:
        """A device view of the first n rows' bitmasks ([n, words] int32)."""
        return self._view(self.device_bytes, "bitmask")[:n]

    def stage(
        self,
        params: dict[str, np.ndarray] | None,
        mask_rows: list[int],
        padded: int,
        bitmask: np.ndarray | None = None,
    ) -> None:
        """Fills the buffers for a step of `padded` rows in one copy. `params` maps each of
        keys ([n, 2] int64), top_k, temperature, top_p, min_p and optionally table_rows
        (rows in the request tables; [n]) to the values of the first n rows (None: no row);
        rows past those given get the 'off' values. `bitmask[r]` is the mask of row r for
        each r in `mask_rows` (other rows allow every token); with no mask row the bitmask
        section is left out of the copy.

        Raises ValueError when more than max_rows rows are staged or a mask row lies past
        `padded`."""
        if padded > self.max_rows:
            raise ValueError(f"padded: {padded} rows exceed the buffers' {self.max_rows}")
        if mask_rows and max(mask_rows) >= padded:
            raise ValueError(f"mask_rows: row {max(mask_rows)} is outside {padded} rows")
        turn = self._turn
        self._turn ^= 1
        if self._copied is not None and not self._copied[turn].query():
            self._copied[turn].synchronize()  # the copy that last read this host set is done
        host = self._host[turn].numpy()
        for name in _PARAMS:
            view = self._view(host, name)
            values = None if params is None else params.get(name)
            n = 0 if values is None else len(values)
            if n:
                view[:n] = values
            view[n:] = self._off[name]
        size = self.params_bytes
        if mask_rows:
            words = self._view(host, "bitmask")
            words[:padded] = -1
            words[mask_rows] = bitmask[mask_rows]
            size += padded * self.words * 4
        elif params is None:  # construction: every row unconstrained
            self._view(host, "bitmask")[:] = -1
            size = self.device_bytes.numel()
        self._copy(turn, size)

    def _copy(self, turn: int, size: int) -> None:
        src = self._host[turn][:size]
        dst = self.device_bytes[:size]
        if self._stream is None:
            dst.copy_(src)
            return
        self._stream.wait_event(self._read)  # the previous step's post-layer work is done
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            self._copied[turn].record(self._stream)
            self._uploaded.record(self._stream)

    def wait_uploaded(self) -> None:
        """Makes the current stream wait for the latest copy (no host wait; CUDA only)."""
        if self._uploaded is not None:
            torch.cuda.current_stream().wait_event(self._uploaded)

    def mark_read(self) -> None:
        """Records that the work queued so far on the current stream is the last to read the
        buffers before the next copy (no host wait; CUDA only)."""
        if self._read is not None:
            self._read.record(torch.cuda.current_stream())


_TORCH = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32}
