"""The adapter a request runs with, as plain typed data that crosses process boundaries."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import msgspec

from vllm.exceptions import InvalidRequestError

if TYPE_CHECKING:
    from vllm.config import LoRAConfig


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Names a PEFT adapter directory: ``LoRARequest(lora_name, lora_int_id, lora_path)``.

    ``lora_int_id`` (a positive integer) is the adapter's identity: two requests with the
    same id share its loaded weights and its prefix-cache blocks.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    # The model the adapter was trained on (informational, shown by /v1/models).
    base_model_name: str | None = None

    @property
    def cache_salt(self) -> int:
        """Seeds the prefix-cache hash chain so that no two adapters (nor an adapter and the
        base model) ever share KV blocks: the same tokens give other keys under each."""
        # A digest, not hash(): str hashes are salted per process.
        key = f"lora\0{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def check_lora_enabled(lora_request: object, lora_config: LoRAConfig | None) -> None:
    """Raises InvalidRequestError when a request names an adapter but LoRA is off (the
    scheduler would otherwise wait forever for an adapter slot that does not exist)."""
    if lora_request is not None and lora_config is None:
        raise InvalidRequestError(
            "lora_request", "LoRA adapters are not enabled; start the engine with "
            "--enable-lora (LLM(enable_lora=True))"
        )
