"""Turning a model name into a local directory: a directory, a demo model, or a Hugging Face
hub id (`ORG/NAME`) found in (or downloaded into) the hub cache.

The environment is read when a name is resolved, not when this module (or huggingface_hub)
is imported, so `HF_HUB_OFFLINE`, `HF_HUB_CACHE`, `HF_HOME` and `HF_TOKEN` set later in the
process still count.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What the engine reads from a checkpoint: its config, tokenizer, chat template and weights.
# Everything else in a repository (PyTorch .bin weights, ONNX, GGUF, images) is left on the hub.
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json")

# ORG/NAME as the hub spells repository ids: letters, digits, '-', '_', '.', one slash.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_TRUE = ("1", "ON", "YES", "TRUE")


def is_hub_id(name: str) -> bool:
    """Whether `name` is spelled like a hub repository id (`ORG/NAME`, no `..`)."""
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name


def hub_offline() -> bool:
    """Whether `HF_HUB_OFFLINE` forbids downloads (read now, not at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE


def hub_cache_dir(download_dir: str | os.PathLike[str] | None = None) -> Path:
    """The hub cache directory: `download_dir`, else `HF_HUB_CACHE`, else `$HF_HOME/hub`,
    else huggingface_hub's default (`~/.cache/huggingface/hub`)."""
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def resolve_model_path(
    name: str | None,
    *,
    field: str = "model",
    revision: str | None = None,
    download_dir: str | os.PathLike[str] | None = None,
    weights: bool = True,
) -> Path:
    """The local directory for a model (or tokenizer) name.

    In order: an existing local directory (one holding just a `.gguf` file stands for that
    file); a local GGUF file (its converted, cached directory: gguf_dir.py); the embedded
    default model (None, "", `smollm2`, or its hub id when the hub cannot provide it); a
    built-in demo model name; a hub id `ORG/NAME` at `revision` (a branch, tag or commit;
    default main), taken from the hub cache (`download_dir`, `HF_HUB_CACHE` or `HF_HOME`)
    or downloaded into it unless `HF_HUB_OFFLINE=1`. Only config, tokenizer and
    chat-template files are fetched, plus the safetensors weights when `weights`. Raises
    ValueError naming `field` when the name is none of these or the id cannot be had.
    """
    from vllm.model_executor.model_loader import default_model
    from vllm.transformers_utils.gguf_dir import find_gguf, gguf_model_dir, is_gguf_file

    if name:
        local = Path(name).expanduser()
        if local.is_dir():
            gguf_file = find_gguf(local)
            if gguf_file is not None and not (local / "config.json").is_file():
                return gguf_model_dir(gguf_file)
            return local
        if is_gguf_file(local):
            return gguf_model_dir(local)
        if local.suffix == ".gguf" and local.exists():
            raise ValueError(f"{field}: {name!r} is not a GGUF file (no GGUF magic bytes)")
    if default_model.is_default_model(name):
        if name == default_model.DEFAULT_MODEL_ID:
            try:
                return _snapshot(name, field=field, revision=revision,
                                 download_dir=download_dir, weights=weights)
            except ValueError:
                pass  # no hub here: the packaged file is the same model
        return default_model.default_model_dir()
    from vllm.model_executor.model_loader.demos import resolve_model_dir

    demo = resolve_model_dir(name)
    if demo.is_dir():
        return demo
    assert name
    if not is_hub_id(name):
        raise ValueError(
            f"{field}: directory {name!r} does not exist (nor is it a GGUF file, a demo "
            "model name or a hub id ORG/NAME)"
        )
    return _snapshot(name, field=field, revision=revision, download_dir=download_dir,
                     weights=weights)


def _snapshot(
    repo_id: str, *, field: str, revision: str | None,
    download_dir: str | os.PathLike[str] | None, weights: bool,
) -> Path:
    """The snapshot directory of `repo_id` at `revision`, via huggingface_hub."""
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir(download_dir)
    offline = hub_offline()
    patterns = [*CONFIG_FILES, *TOKENIZER_FILES, *(WEIGHT_FILES if weights else ())]
    at = f" at revision {revision!r}" if revision else ""
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache),
            allow_patterns=patterns,
            local_files_only=offline,
            token=os.environ.get("HF_TOKEN") or None,
        )
    except Exception as exc:  # huggingface_hub's many error types: not found, gated, offline
        if offline:
            why = (f"it is not in the hub cache {str(cache)!r} and HF_HUB_OFFLINE=1 forbids "
                   "downloading it")
        else:
            why = (f"it is not in the hub cache {str(cache)!r} and could not be downloaded "
                   f"({type(exc).__name__}: {_first_line(exc)})")
        raise ValueError(
            f"{field}: {repo_id!r}{at} is not a local directory or demo model, and {why}"
        ) from None
    return Path(path)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no details"
