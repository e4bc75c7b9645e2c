"""The models the server answers to: GET /v1/models, the `model` field check, and the LoRA
adapters served under their own names (--lora-modules, /v1/load_lora_adapter)."""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass, field

from vllm.entrypoints.openai.protocol import ModelCard, ModelList
from vllm.exceptions import InvalidRequestError
from vllm.lora.request import LoRARequest
from vllm.lora.validation import LoRAValidator


@dataclass
class LoRAModulePath:
    """One `--lora-modules` entry: an adapter served as model `name`."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """Parses `name=path` or `{"name": ..., "path": ..., "base_model_name": ...}`.

    Raises ValueError naming the entry when it is neither.
    """
    text = text.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({e})") from None
        if not isinstance(data, dict) or set(data) - {"name", "path", "base_model_name"}:
            raise ValueError(f"--lora-modules: {text!r} may have only the keys name, path "
                             "and base_model_name")
        name, path = data.get("name"), data.get("path")
        base = data.get("base_model_name")
    else:
        name, sep, path = text.partition("=")
        base = None
        if not sep:
            raise ValueError(f"--lora-modules: {text!r} must be name=path or a JSON object")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules: {text!r} needs a non-empty name and path")
    return LoRAModulePath(name, path, base if isinstance(base, str) else None)


@dataclass
class OpenAIServingModels:
    """Served model names (the first is the default) and what they point to; with LoRA
    enabled (`lora_validator` set), adapters by name."""

    served_model_names: list[str]
    model_path: str
    max_model_len: int
    lora_validator: LoRAValidator | None = None
    lora_requests: dict[str, LoRARequest] = field(default_factory=dict)
    # Every adapter loaded gets a new id, so a name loaded again after an unload (maybe
    # another directory) never meets the old one's cached weights or KV blocks.
    _lora_ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    # Names whose load is reading its files (loads run off the event loop, several at once).
    _loading: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def default_name(self) -> str:
        """The name a request without `model` gets."""
        return self.served_model_names[0]

    def resolve(self, name: str | None) -> str | None:
        """The served name a request's `model` refers to (None -> default; a base model name
        or an adapter name); None if unknown, the empty name included."""
        if name is None:
            return self.default_name
        if name in self.served_model_names or name in self.lora_requests:
            return name
        return None

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names, or None for the base model."""
        return self.lora_requests.get(name) if name else None

    def load_lora_adapter(self, name: str, path: str, base_model_name: str | None = None
                          ) -> LoRARequest:
        """Checks the adapter's files and serves it as model `name`.

        Raises InvalidRequestError when LoRA is off, the name is taken (or another load of
        it is still running), or the adapter is unfit (missing/corrupt files, rank,
        targets; see load_adapter). Reads the files: call it off the event loop.
        """
        if self.lora_validator is None:
            raise InvalidRequestError("lora_name", "LoRA adapters are not enabled; start "
                                      "the server with --enable-lora")
        if not name or not path:
            raise InvalidRequestError("lora_name", "lora_name and lora_path are required")
        with self._lock:
            if name in self.lora_requests or name in self.served_model_names:
                raise InvalidRequestError("lora_name", f"the name {name!r} is already served")
            if name in self._loading:
                raise InvalidRequestError("lora_name", f"the name {name!r} is already being "
                                          "loaded")
            self._loading.add(name)
        try:
            request = LoRARequest(name, next(self._lora_ids), path,
                                  base_model_name or self.default_name)
            self.lora_validator.check(request)
            with self._lock:
                self.lora_requests[name] = request
        finally:
            with self._lock:
                self._loading.discard(name)
        return request

    def unload_lora_adapter(self, name: str) -> LoRARequest | None:
        """Stops serving the adapter `name`; returns it, or None when no adapter has that
        name. Requests already running with it finish with it."""
        with self._lock:
            request = self.lora_requests.pop(name, None)
        if request is not None and self.lora_validator is not None:
            self.lora_validator.forget(request)
        return request

    def show_available_models(self) -> ModelList:
        """The body of GET /v1/models: the base model names, then each adapter, whose
        `parent` is the model it runs on."""
        cards = [
            ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len)
            for name in self.served_model_names
        ]
        cards += [
            ModelCard(id=name, root=request.lora_path, parent=self.default_name,
                      max_model_len=self.max_model_len)
            for name, request in self.lora_requests.items()
        ]
        return ModelList(data=cards)
