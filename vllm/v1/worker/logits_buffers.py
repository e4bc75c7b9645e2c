"""Reused host memory for the logits of the steps in flight (CPU only).

A step's logits are [rows, vocabulary] float32: 155 MB at 256 rows of a 151,936-token
vocabulary. A fresh tensor of that size is mapped from the OS, page-faulted in while the LM
head writes it and unmapped when the step is sampled; on a CPU that costs a fifth of the LM
head itself. The runner instead takes a buffer here before the LM head and gives it back once
the step is sampled. Several steps can be in flight (async scheduling, deferred structured
steps), so buffers are pooled, not single.
"""

from __future__ import annotations

import torch


class LogitsBuffers:
    """A pool of [capacity, vocab] float32 CPU tensors handed out as [rows, vocab] views."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size: must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self._free: list[torch.Tensor] = []
        # id of a handed-out view -> (the view, kept so its id stays unique; its buffer).
        self._lent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def take(self, rows: int) -> torch.Tensor:
        """A contiguous [rows, vocab] float32 tensor (uninitialised) that nobody else holds
        until it is given back. Reuses the smallest free buffer that fits, else allocates
        one rounded up to a power of two of rows (so a growing batch reallocates rarely)."""
        if rows < 1:
            raise ValueError(f"rows: must be positive, got {rows}")
        fits = [b for b in self._free if b.shape[0] >= rows]
        if fits:
            buffer = min(fits, key=lambda b: b.shape[0])
            self._drop(buffer)
        else:
            # A smaller free buffer would never fit a batch this size again soon: drop one.
            if self._free:
                self._drop(min(self._free, key=lambda b: b.shape[0]))
            capacity = 1 << (rows - 1).bit_length()
            buffer = torch.empty((capacity, self.vocab_size), dtype=torch.float32)
        view = buffer[:rows]
        self._lent[id(view)] = (view, buffer)
        return view

    def _drop(self, buffer: torch.Tensor) -> None:
        # By identity: list.remove would compare tensors elementwise.
        self._free = [b for b in self._free if b is not buffer]

    def give(self, view: torch.Tensor) -> None:
        """Returns a tensor from take(); the caller must not use it afterwards. A tensor
        that did not come from take() (or was given back already) is ignored."""
        lent = self._lent.pop(id(view), None)
        if lent is not None:
            self._free.append(lent[1])

    @property
    def num_lent(self) -> int:
        """How many buffers are handed out now."""
        return len(self._lent)
