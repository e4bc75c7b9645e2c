"""The models the server answers to: GET /v1/models, the `model` field check, and the LoRA
adapters served under their own names (--lora-modules, /v1/load_lora_adapter)."""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm.entrypoints.openai.protocol import ModelCard, ModelList
from vllm.exceptions import InvalidRequestError
from vllm.lora.request import LoRARequest
from vllm.lora.validation import LoRAValidator

# Upstream's switch for the adapter admin routes (/v1/load_lora_adapter and
# /v1/unload_lora_adapter): without it (or --allow-runtime-lora-updating) they do not exist,
# because they read files from the server's disk on a client's word.
ALLOW_RUNTIME_LORA_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

# The one answer to a runtime adapter path outside the allowed directories, whether or not
# something is there: a different answer would let a client map the server's disk.
LORA_PATH_OUTSIDE_ROOTS = (
    "adapters load at run time only from inside the directories that hold the "
    "--lora-modules adapters or a --lora-allowed-dir, and this path is not inside one"
)


def runtime_lora_updating_allowed(flag: bool = False) -> bool:
    """True when the adapter admin routes may exist: `flag` (--allow-runtime-lora-updating)
    is set or VLLM_ALLOW_RUNTIME_LORA_UPDATING is "1" or "true" (any case).

    The environment is read on each call, i.e. when the app is built, so setting the variable
    after `vllm` was imported (as a test or an embedding program does) still counts.
    """
    value = os.environ.get(ALLOW_RUNTIME_LORA_UPDATING_ENV, "").strip().lower()
    return flag or value in ("1", "true")


def lora_allowed_roots(module_paths: Iterable[str], allowed_dirs: Iterable[str]) -> list[str]:
    """The directories runtime adapter paths must resolve inside: the parent directory of
    each --lora-modules adapter and each --lora-allowed-dir, symlinks resolved.

    Raises ValueError naming the flag when an allowed directory is not a directory (a typo
    would otherwise refuse every load with no hint why).
    """
    roots: list[str] = []
    for path in module_paths:
        roots.append(os.path.dirname(os.path.realpath(path)))
    for path in allowed_dirs:
        real = os.path.realpath(path)
        if not os.path.isdir(real):
            raise ValueError(f"--lora-allowed-dir: {path!r} is not a directory")
        roots.append(real)
    return list(dict.fromkeys(roots))


def confine_lora_path(path: str, roots: Iterable[str]) -> str:
    """`path` with symlinks and `..` resolved, when that lies inside one of `roots` (already
    resolved, see lora_allowed_roots).

    Raises InvalidRequestError (param lora_path) with the same message for every path
    outside, existing or not, and for one that cannot be resolved (a NUL byte).
    """
    try:
        # realpath resolves `..` and every symlink, the last component's included, so neither
        # a `../..` nor a link placed inside a root can lead the check out of it.
        real = os.path.realpath(path)
    except (OSError, ValueError):
        real = None
    if real is not None:
        for root in roots:
            if os.path.commonpath([real, root]) == root:
                return real
    raise InvalidRequestError("lora_path", LORA_PATH_OUTSIDE_ROOTS)


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
    # Where /v1/load_lora_adapter may read adapters from (lora_allowed_roots); empty: nowhere.
    lora_allowed_roots: list[str] = field(default_factory=list)
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

    def load_runtime_lora_adapter(self, name: str, path: str,
                                  base_model_name: str | None = None) -> LoRARequest:
        """load_lora_adapter for a path a client sent (/v1/load_lora_adapter): served from its
        resolved path when that lies inside lora_allowed_roots.

        Raises InvalidRequestError as load_lora_adapter does, and with one message for any
        path outside the roots (confine_lora_path). Reads the files: call it off the event
        loop.
        """
        # Loading the resolved path, not the given one, reads the very files the check
        # approved even if a link on the way is swapped afterwards.
        real = confine_lora_path(path, self.lora_allowed_roots)
        return self.load_lora_adapter(name, real, base_model_name)

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
