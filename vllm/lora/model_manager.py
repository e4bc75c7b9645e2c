"""Puts LoRA layers into a model and keeps adapters in its slots (device) and on the host.

Slots are filled on demand for each step's adapters and evicted least recently used; the
host cache keeps up to `max_cpu_loras` loaded adapters so a re-activated one is not read
from disk again. The scheduler guarantees at most `max_loras` distinct adapters per step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from vllm.config import LoRAConfig
from vllm.lora.layers import LoRABatch, LoRALinear, lora_backend
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.lora.peft_adapter import LoRAAdapter, load_adapter
from vllm.lora.request import LoRARequest

# Wrapped attribute -> the projections fused in it, in fused order.
_FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def _lora_layer(base: nn.Module, batch: LoRABatch, config: LoRAConfig, dtype: torch.dtype,
                device: torch.device) -> LoRALinear:
    """A LoRALinear over `base` holding this rank's shard of each adapter."""
    kw: dict = {}
    if isinstance(base, MergedColumnParallelLinear):
        sizes = list(base.output_sizes)
        kw["out_shards"] = list(base.shards)
    elif isinstance(base, RowParallelLinear):
        sizes = [base.output_size]
        kw["in_shard"] = (base.input_start, base.local_input_size)
        if base.parallel.tp_size > 1:
            kw["reduce"] = base.parallel.all_reduce
    else:
        raise TypeError(f"LoRA cannot wrap a {type(base).__name__}")
    return LoRALinear(base, base.local_input_size, sizes, batch, config.max_loras,
                      config.max_lora_rank, dtype, device, **kw)


class LoRAModelManager:
    """Owns a model's LoRA layers, its slots and the host cache of loaded adapters."""

    def __init__(
        self,
        model: nn.Module,
        lora_config: LoRAConfig,
        device: torch.device,
        dtype: torch.dtype,
        min_rows: int,
        to_device: Callable[[np.ndarray], torch.Tensor],
    ) -> None:
        """Wraps `model`'s projections (on `device`, in `dtype`); `min_rows` and
        `to_device` as in LoRABatch."""
        self.model = model
        self.config = lora_config
        self.hf_config = model.config
        self.batch = LoRABatch(to_device, min_rows, lora_config.max_loras, lora_backend())
        # (layer index, projection) -> (its LoRA layer, part index in it).
        self.targets: dict[tuple[int, str], tuple[LoRALinear, int]] = {}
        self._wrap(device, dtype)
        # lora_int_id -> slot, least recently used first.
        self.slots: OrderedDict[int, int] = OrderedDict()
        self.free_slots = list(range(lora_config.max_loras))
        # lora_int_id -> loaded adapter, least recently used first.
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()

    def _wrap(self, device: torch.device, dtype: torch.dtype) -> None:
        """Replaces this stage's projections with LoRA layers."""
        cfg = self.config
        for index in self.model.model.stage:
            block = self.model.model.layers[index]
            for owner in (block.self_attn, block.mlp):
                for attr, parts in _FUSED.items():
                    base = getattr(owner, attr, None)
                    if base is None:
                        continue
                    layer = _lora_layer(base, self.batch, cfg, dtype, device)
                    setattr(owner, attr, layer)
                    for part, name in enumerate(parts):
                        self.targets[(index, name)] = (layer, part)

    # ------------------------------------------------------------------ adapters

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The loaded adapter of a request, from the host cache or read from its path."""
        adapter = self.host.get(request.lora_int_id)
        if adapter is not None:
            self.host.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request.lora_path, self.hf_config, self.config.max_lora_rank)
        self.host[request.lora_int_id] = adapter
        while len(self.host) > self.config.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer in {layer for layer, _ in self.targets.values()}:
            layer.clear_slot(slot)
        for key, (a, b) in adapter.weights.items():
            target = self.targets.get(key)
            if target is None:
                continue  # a layer of another pipeline stage (the front end checked names)
            layer, part = target
            layer.set_part(slot, part, a, b)

    def activate(
        self, requests: Sequence[LoRARequest | None]
    ) -> tuple[np.ndarray, dict[int, str]]:
        """The slot of each request's adapter (-1: none), loading adapters into slots as
        needed, and the adapters that failed to load (lora_int_id -> why; their requests
        get -1 and their slots stay free). Slots of adapters this step does not use are
        evicted least recently used first. Raises RuntimeError when the step has more than
        max_loras adapters (the scheduler never builds one)."""
        wanted: dict[int, LoRARequest] = {}
        for request in requests:
            if request is not None:
                wanted.setdefault(request.lora_int_id, request)
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(
                f"a step with {len(wanted)} adapters; --max-loras is {self.config.max_loras}"
            )
        failed: dict[int, str] = {}
        for lora_id, request in wanted.items():
            if lora_id in self.slots:
                self.slots.move_to_end(lora_id)
                continue
            if not self.free_slots:
                victim = next(i for i in self.slots if i not in wanted)
                self.free_slots.append(self.slots.pop(victim))
            slot = self.free_slots.pop()
            try:
                self._fill(slot, self._adapter(request))
            except ValueError as e:
                # Checked when admitted, so its files changed since: only its requests fail.
                self.free_slots.append(slot)
                failed[lora_id] = str(e)
                continue
            except BaseException:
                self.free_slots.append(slot)
                raise
            self.slots[lora_id] = slot
        slots = [-1 if r is None or r.lora_int_id in failed else self.slots[r.lora_int_id]
                 for r in requests]
        return np.asarray(slots, dtype=np.int64), failed

    def remove(self, lora_int_id: int) -> None:
        """Forgets an adapter (unloaded): its slot and host copy are released."""
        self.host.pop(lora_int_id, None)
        slot = self.slots.pop(lora_int_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def set_batch(
        self, requests: Sequence[LoRARequest | None], num_tokens: np.ndarray, num_rows: int
    ) -> dict[int, str]:
        """Puts the adapters of the next forward's requests into slots (see activate, and its
        errors) and gives each of its `num_rows` token rows its request's slot: request i owns
        the next num_tokens[i] rows; padding rows and base-model requests get -1. Returns the
        adapters that failed to load (lora_int_id -> why)."""
        slots, failed = self.activate(requests)
        token_slots = np.full(num_rows, -1, dtype=np.int64)
        token_slots[: int(num_tokens.sum())] = np.repeat(slots, num_tokens)
        self.batch.set_token_slots(token_slots)
        return failed
