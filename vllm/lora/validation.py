"""Front-end checks of a request's adapter, so a bad one is the caller's error and never
reaches the engine core (whose runner would otherwise fail the whole step)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from vllm.config import VllmConfig
from vllm.exceptions import InvalidRequestError
from vllm.lora.peft_adapter import load_adapter
from vllm.lora.request import LoRARequest, check_lora_enabled

# Adapters checked recently, so a busy adapter is not re-read from disk for every request.
_MAX_REMEMBERED = 256


class LoRAValidator:
    """Checks LoRARequests against the engine's LoRA configuration and model."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.lora_config = vllm_config.lora_config
        self.hf_config = vllm_config.model_config.hf_config
        self._checked: OrderedDict[LoRARequest, None] = OrderedDict()
        # The server checks requests in worker threads.
        self._lock = threading.Lock()

    def check(self, request: LoRARequest) -> None:
        """Raises InvalidRequestError when LoRA is off, the request is malformed, or the
        adapter's files are missing, corrupt or unfit for the model (see load_adapter)."""
        check_lora_enabled(request, self.lora_config)
        if not isinstance(request, LoRARequest):
            raise InvalidRequestError(
                "lora_request", f"must be a LoRARequest, got {type(request).__name__}"
            )
        lora_id = request.lora_int_id
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 1:
            raise InvalidRequestError(
                "lora_request", f"lora_int_id must be a positive integer, got {lora_id!r}"
            )
        if not request.lora_path:
            raise InvalidRequestError("lora_request", "lora_path must name a directory")
        with self._lock:
            if request in self._checked:
                self._checked.move_to_end(request)
                return
        # Outside the lock: reading an adapter takes a while.
        load_adapter(request.lora_path, self.hf_config, self.lora_config.max_lora_rank)
        with self._lock:
            self._checked[request] = None
            while len(self._checked) > _MAX_REMEMBERED:
                self._checked.popitem(last=False)

    def forget(self, request: LoRARequest) -> None:
        """Drops a remembered check (the adapter's files may change after an unload)."""
        with self._lock:
            self._checked.pop(request, None)
