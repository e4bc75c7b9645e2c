"""Counting what code asks of the device: its operations, and those that make the host wait.

On CUDA, `torch.cuda.set_sync_debug_mode` reports synchronisations as they happen; on a CPU
nothing waits, so structural checks (the tests, benchmarks/gpu_profile.py --cpu) count the
operations that would make a CUDA host wait instead, whichever device runs them:
  - reading a device value on the host: .item(), int(t), bool(t), float(t) (one
    aten::_local_scalar_dense each);
  - results whose shape depends on device values: nonzero, masked_select, unique,
    repeat_interleave without output_size, and indexing by a boolean mask;
  - copies from the device to the host (`downloads`; a non-blocking one into pinned memory
    does not wait, which the caller can tell from the flag recorded with it).
Run on "meta" tensors (as the tests do), code shows its device path without a GPU: its
device-type checks take their non-CPU branches, and an operation that needs a device value
on the host cannot run at all (it raises, after being recorded here).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operations whose result the host must wait for, or whose output shape depends on values.
SYNC_OPS = frozenset({
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique",
    "aten._unique",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
    "aten.is_nonzero",
    "aten.equal",
})
# Operations that only make a new view or alias of existing memory: no kernel runs.
NO_KERNEL_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.slice", "aten.select", "aten.detach", "aten.alias",
    "aten.as_strided", "aten.expand", "aten.unsqueeze", "aten.squeeze", "aten.transpose",
    "aten.t", "aten.permute", "aten.reshape", "aten.resolve_conj", "aten.resolve_neg",
    "aten.to", "aten.lift_fresh", "aten.split", "aten.unbind", "aten.narrow", "aten.unfold",
    "aten.view_as_real", "aten.view_as_complex", "aten._reshape_alias",
})
_INDEXING = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"})
_COPIES = frozenset({"aten._to_copy", "aten.copy_", "aten.copy"})


def _tensors(*groups: tuple | list | dict) -> list[torch.Tensor]:
    """The tensors among operator arguments: aten arguments are flat, or lists of tensors
    (indices, cat), so one level is enough (much cheaper than a pytree walk per op)."""
    out: list[torch.Tensor] = []
    for group in groups:
        for x in group.values() if isinstance(group, dict) else group:
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple)):
                out.extend(t for t in x if isinstance(t, torch.Tensor))
    return out


class OpAudit(TorchDispatchMode):
    """Records, while active on this thread, every operation that touches a tensor on a
    device of type `device_type` ("cpu" counts every operation of a CPU run; "meta" counts
    the device work of code run on meta tensors and leaves out its host-side staging)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing is compiled under the audit: keeping torch's default (wrapping the hook
        # to skip compilation) would import the compiler, seconds on first use.
        return False

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        self.ops: list[str] = []  # in order, e.g. "aten.argmax"
        self.syncs: list[str] = []  # the operations that would make the host wait
        self.downloads: list[bool] = []  # device -> host copies: each one's non_blocking
        self.uploads = 0  # host -> device copies
        self._paused = 0

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leaves out what runs inside the block (e.g. the model's forward)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def launches(self) -> list[str]:
        """The recorded operations that run a kernel (views and aliases left out)."""
        return [op for op in self.ops if op not in NO_KERNEL_OPS]

    def counts(self) -> Counter:
        """How many times each recorded operation ran."""
        return Counter(self.ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused:
            # Recorded before it runs: on meta tensors the operations that need values raise.
            self._record(str(func.overloadpacket), args, kwargs)
        return func(*args, **kwargs)

    def _record(self, name: str, args: tuple, kwargs: dict) -> None:
        inputs = _tensors(args, kwargs)
        target = kwargs.get("device")
        target = torch.device(target).type if target is not None else None
        if name in _COPIES:
            self._record_copy(name, args, kwargs, inputs, target)
        devices = {t.device.type for t in inputs}
        if name == "aten._to_copy" and target is not None:
            devices = {target}  # a copy works on the device it writes
        elif target is not None:
            devices.add(target)  # factories (empty, arange, full, ...)
        if self.device_type not in devices:
            return
        self.ops.append(name)
        unsized = name == "aten.repeat_interleave" and kwargs.get("output_size") is None
        if name in SYNC_OPS or unsized:
            self.syncs.append(name)
        elif name in _INDEXING and any(
            t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1:2])
        ):
            self.syncs.append(f"{name} (boolean mask)")

    def _record_copy(
        self, name: str, args: tuple, kwargs: dict, inputs: list[torch.Tensor],
        target: str | None,
    ) -> None:
        if name == "aten.copy_":
            dst, src = args[0].device.type, args[1].device.type
            non_blocking = bool(args[2]) if len(args) > 2 else kwargs.get("non_blocking", False)
        else:
            if not inputs or target is None:
                return
            src, dst = inputs[0].device.type, target
            non_blocking = bool(kwargs.get("non_blocking", False))
        if src == dst:
            return
        if dst == "cpu":
            self.downloads.append(non_blocking)
        elif src == "cpu":
            self.uploads += 1
