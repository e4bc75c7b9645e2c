"""Loading a Hugging Face tokenizer from a local model directory, a demo model name or a
hub id (network only to download a hub id that is not cached)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

# tokenizer_config.json keys that describe how to load, not what to configure.
_LOADING_KEYS = (
    "tokenizer_class",
    "auto_map",
    "added_tokens_decoder",
    "tokenizer_file",
    "name_or_path",
)


def get_tokenizer(
    tokenizer_name: str | Path,
    *args: Any,
    tokenizer_mode: str = "auto",
    trust_remote_code: bool = False,
    revision: str | None = None,
    download_dir: str | None = None,
    **kwargs: Any,
) -> PreTrainedTokenizerFast:
    """Load the fast tokenizer named `tokenizer_name`: a local directory, a demo model name,
    or a hub id `ORG/NAME` at `revision` (from the hub cache, downloaded unless
    HF_HUB_OFFLINE=1; see vllm/transformers_utils/hub.py).

    Called as upstream vLLM's `get_tokenizer`: `tokenizer_mode` is auto, hf or slow (all load
    the fast tokenizer; slow with a warning), `trust_remote_code` is accepted and ignored (no
    code shipped with a model runs here), `cache_dir` is `download_dir`, and `use_fast=True`
    is accepted. Raises ValueError naming the argument for anything else, or when no usable
    tokenizer is found.
    """
    from vllm.config import TOKENIZER_MODES
    from vllm.transformers_utils.hub import resolve_model_path

    if args:
        raise ValueError(f"get_tokenizer: unexpected positional arguments {args!r}; pass "
                         "options by keyword")
    download_dir = download_dir or kwargs.pop("cache_dir", None)
    if kwargs.pop("use_fast", True) is not True:
        raise ValueError("get_tokenizer: use_fast=False is not supported (only fast "
                         "tokenizers run here)")
    if kwargs:
        raise ValueError(f"get_tokenizer: unsupported keyword argument(s) {sorted(kwargs)}")
    if tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode: {tokenizer_mode!r} is not one of "
                         f"{', '.join(TOKENIZER_MODES)}")
    if tokenizer_mode == "slow":
        logger.warning("tokenizer_mode slow: only fast tokenizers run here; loading the "
                       "fast one")
    path = resolve_model_path(str(tokenizer_name), field="tokenizer", revision=revision,
                              download_dir=download_dir, weights=False)
    return _load_dir(path)


def get_model_tokenizer(model_config: Any) -> PreTrainedTokenizerFast:
    """The tokenizer an engine serves `model_config` with (its `tokenizer`).

    Raises ValueError naming --tokenizer when a GGUF model carries its own vocabulary and
    the given tokenizer's size differs from it: its ids would mean other tokens.
    """
    tokenizer = get_tokenizer(model_config.tokenizer)
    gguf_file = model_config.gguf_file
    if gguf_file is None:
        return tokenizer
    from vllm.model_executor.model_loader.gguf_loader import read_index

    expected = read_index(gguf_file.parent).get("tokenizer_size")
    if expected is not None and len(tokenizer) != expected:
        raise ValueError(
            f"--tokenizer: {model_config.tokenizer!r} has {len(tokenizer)} tokens but the "
            f"GGUF file {str(gguf_file)!r} was made with a {expected}-token vocabulary; "
            "leave --tokenizer out to use the file's own")
    return tokenizer


def _load_dir(path: Path) -> PreTrainedTokenizerFast:
    """Load the fast tokenizer of the local model directory `path`.

    Uses `tokenizer.json` plus the settings in `tokenizer_config.json` (special tokens,
    chat template; `chat_template.jinja` if present). Directories without a `tokenizer.json`
    go through `AutoTokenizer` with `local_files_only=True`. Never touches the network.
    Raises ValueError if `path` is not a directory or holds no usable tokenizer.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ValueError(f"tokenizer: directory {str(path)!r} does not exist")  # raced away
    config = _read_config(root)
    tokenizer_file = root / "tokenizer.json"
    if not tokenizer_file.is_file():
        if (root / "model.gguf").exists():
            raise ValueError(f"tokenizer: the GGUF file behind {str(root)!r} has no tokenizer "
                             "in its metadata; pass --tokenizer")
        return _auto_tokenizer(root)
    kwargs = {k: v for k, v in config.items() if k not in _LOADING_KEYS}
    template = root / "chat_template.jinja"
    if template.is_file():
        kwargs["chat_template"] = template.read_text(encoding="utf-8")
    try:
        return PreTrainedTokenizerFast(
            tokenizer_file=str(tokenizer_file), name_or_path=str(root), **kwargs
        )
    except Exception as exc:
        raise ValueError(f"tokenizer: cannot load {str(tokenizer_file)!r}: {exc}") from exc


def _read_config(root: Path) -> dict[str, Any]:
    """Return tokenizer_config.json as a dict ({} if absent). Raises ValueError if malformed."""
    path = root / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"tokenizer: cannot read {str(path)!r}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"tokenizer: {str(path)!r} is not a JSON object")
    return config


def _auto_tokenizer(root: Path) -> PreTrainedTokenizerFast:
    """Load a directory without tokenizer.json (e.g. sentencepiece) through AutoTokenizer."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(root), local_files_only=True, use_fast=True)
    except Exception as exc:
        raise ValueError(f"tokenizer: no usable tokenizer in {str(root)!r}: {exc}") from exc
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise ValueError(f"tokenizer: {str(root)!r} has no fast tokenizer")
    return tok


def control_token_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokens that are never text: the special ones (`<|im_start|>`, EOS,
    padding). Added tokens marked not special (Qwen's `<think>`, `<tool_call>`) are text, as
    decoding shows them even with skip_special_tokens."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    for idx, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", True):
            ids.add(idx)
    return ids
