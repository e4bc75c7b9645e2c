"""Persistent device buffers for a step's inputs, filled from host arrays without a sync.

On CUDA each step's arrays go through pinned host memory and are copied asynchronously into
fixed device buffers (CUDA graphs need fixed addresses). Two pinned sets alternate, and a set is
only rewritten after the copies that read it two steps ago have finished, so the host never
overwrites memory an in-flight copy still reads. On CPU the arrays are used in place.
"""

from __future__ import annotations

import numpy as np
import torch

# name -> (dtype, shape after the leading dimension)
_LAYOUT = {
    "input_ids": (torch.int64, ()),
    "positions": (torch.int64, ()),
    "slot_mapping": (torch.int64, ()),
    "query_start_loc": (torch.int32, ()),
    "seq_lens": (torch.int32, ()),
    "block_table": (torch.int32, None),  # trailing dim = max blocks per request
}


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A one-off copy of a small host array to `device` that does not block the host
    (pinned, non_blocking; the caching host allocator keeps the pinned copy alive until the
    transfer is done). Zero-copy on CPU."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class InputBuffers:
    """Stages named host arrays into device tensors (see module docstring)."""

    def __init__(
        self, max_num_tokens: int, max_num_reqs: int, max_num_blocks: int, device: torch.device
    ) -> None:
        self.device = device
        self.max_num_tokens = max_num_tokens
        self.on_cpu = device.type == "cpu"
        if self.on_cpu:
            return
        rows = {
            "input_ids": max_num_tokens,
            "positions": max_num_tokens,
            "slot_mapping": max_num_tokens,
            "query_start_loc": max_num_reqs + 1,
            "seq_lens": max_num_reqs,
            "block_table": max_num_reqs,
        }
        self.device_buffers: dict[str, torch.Tensor] = {}
        self.pinned: list[dict[str, torch.Tensor]] = [{}, {}]
        for name, (dtype, tail) in _LAYOUT.items():
            shape = (rows[name],) + ((max_num_blocks,) if tail is None else tail)
            self.device_buffers[name] = torch.zeros(shape, dtype=dtype, device=device)
            for pinned in self.pinned:
                pinned[name] = torch.zeros(shape, dtype=dtype, pin_memory=True)
        self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn = 0

    def stage(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Returns device tensors holding `arrays` (leading-dimension slices of the persistent
        buffers on CUDA; zero-copy views on CPU). Raises ValueError if an array is too long."""
        if self.on_cpu:
            return {name: torch.from_numpy(a) for name, a in arrays.items()}
        turn = self._turn
        self._turn ^= 1
        # The copies that last read this pinned set must be done (queried first: they
        # almost always are, and then the host makes no synchronising call at all).
        if not self.events[turn].query():
            self.events[turn].synchronize()
        out = {}
        for name, array in arrays.items():
            n = array.shape[0]
            buffer = self.device_buffers[name]
            if n > buffer.shape[0]:
                raise ValueError(f"{name}: {n} rows exceed the staging buffer ({buffer.shape[0]})")
            host = self.pinned[turn][name][:n]
            if array.ndim == 2:
                host = host[:, : array.shape[1]]
                target = buffer[:n, : array.shape[1]]
            else:
                target = buffer[:n]
            host.numpy()[...] = array
            target.copy_(host, non_blocking=True)
            out[name] = target
        self.events[turn].record()
        return out

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """host_to_device on this buffers' device."""
        return host_to_device(array, self.device)
