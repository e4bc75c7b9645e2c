"""Loading a Hugging Face tokenizer from a local model directory, with no network."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

# tokenizer_config.json keys that describe how to load, not what to configure.
_LOADING_KEYS = (
    "tokenizer_class",
    "auto_map",
    "added_tokens_decoder",
    "tokenizer_file",
    "name_or_path",
)


def get_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load the fast tokenizer of the local model directory `path`.

    Uses `tokenizer.json` plus the settings in `tokenizer_config.json` (special tokens,
    chat template; `chat_template.jinja` if present). Directories without a `tokenizer.json`
    go through `AutoTokenizer` with `local_files_only=True`. Never touches the network.
    Raises ValueError if `path` is not a directory or holds no usable tokenizer.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ValueError(f"tokenizer: directory {str(path)!r} does not exist")
    config = _read_config(root)
    tokenizer_file = root / "tokenizer.json"
    if not tokenizer_file.is_file():
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
