"""A GGUF file seen as a Hugging Face model directory.

A `.gguf` file carries the config, tokenizer and chat template in its metadata. The first time
a file is served, transformers' GGUF support turns that metadata into `config.json` and the
tokenizer files (as upstream vLLM does); they are cached under
`<cache root>/gguf/<stem>-<key>/` beside a link `model.gguf` to the file itself, so the rest
of the engine (config, tokenizer, loader) reads one ordinary directory. An index of the
tensors (`gguf_tensors.json`) lets a load skip the metadata. The file's metadata is parsed
once: transformers' config and tokenizer loaders are handed the reader this module already
opened (each would otherwise parse the file again, ~4 s apiece for SmolLM2's 49k-token
vocabulary). The conversion costs about 6 s for SmolLM2-135M; later starts read the cache.
The weights stay in the GGUF file: model_loader/gguf_loader.py dequantizes them at load.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# general.architecture -> the model class that serves it.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
GGUF_LINK = "model.gguf"
# Where each tensor lies in the file, so a load maps it without parsing the metadata again
# (GGUFReader spends ~3.5 s on SmolLM2's 98k tokenizer strings).
TENSOR_INDEX = "gguf_tensors.json"
# Bump when what a conversion writes changes, so stale caches are not reused.
CONVERT_VERSION = "v1"

# GGUF sampling hints (general.sampling.*) -> generation_config.json keys.
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def is_gguf_file(path: Path) -> bool:
    """Whether `path` is a regular file that starts with the GGUF magic bytes."""
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def find_gguf(directory: Path) -> Path | None:
    """The GGUF file a directory stands for: its `model.gguf` link, else its only `*.gguf`
    file when it has no `config.json`; None otherwise."""
    link = directory / GGUF_LINK
    if link.exists():
        return link
    files = sorted(directory.glob("*.gguf"))
    if len(files) == 1 and not (directory / "config.json").is_file():
        return files[0]
    return None


def open_gguf(path: Path) -> Any:
    """A `gguf.GGUFReader` over `path` (memory-mapped; nothing is dequantized).

    Raises ValueError naming the file when it is not a complete GGUF file (bad magic,
    unsupported version, truncated header or tensor data).
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError, IndexError, struct errors...
        raise ValueError(f"model: {str(path)!r} is not a readable GGUF file: "
                         f"{type(exc).__name__}: {exc}") from None
    for tensor in reader.tensors:
        if tensor.data.nbytes != int(tensor.n_bytes):
            raise ValueError(
                f"model: {str(path)!r} is truncated: tensor {tensor.name!r} should hold "
                f"{int(tensor.n_bytes)} bytes, the file has {tensor.data.nbytes}")
    return reader


def field_value(reader: Any, key: str) -> Any:
    """The value of metadata field `key` (str, number, bool or list), None when absent."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def architecture_of(reader: Any, path: Path) -> str:
    """The file's `general.architecture` (`llama`, `qwen2`, `qwen3`). Raises ValueError
    naming the key when the architecture is missing or not served here."""
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"general.architecture: {arch!r} in {str(path)!r} is not served here; supported "
            f"GGUF architectures: {', '.join(ARCHITECTURES)}")
    return arch


def gguf_model_dir(
    path: Path,
    cache_root: Path | None = None,
    sampling: dict[str, float] | None = None,
) -> Path:
    """The cached model directory of GGUF file `path`, converting it on first use.

    `sampling` adds generation-config sampling defaults the file's metadata lacks (they
    win over the file's). The cache key is the file's absolute path, size and modification
    time and `sampling`, so a replaced file is converted again. Raises ValueError for an
    unreadable file or an architecture that is not served, OSError if the cache cannot be
    written.
    """
    from vllm.model_executor.model_loader.demo_model import build_cached, default_cache_root

    path = Path(path).expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha256(
        f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERT_VERSION}|{sorted((sampling or {}).items())}"
        .encode()).hexdigest()[:16]
    root = default_cache_root() if cache_root is None else Path(cache_root).expanduser()
    final = root / "gguf" / f"{path.stem}-{key}"
    return build_cached(final, lambda tmp: _convert(path, tmp, sampling or {}))


def _convert(path: Path, out: Path, sampling: dict[str, float]) -> None:
    """Write config.json, generation_config.json, the tokenizer (when the file has one) and
    the `model.gguf` link into the empty directory `out`."""
    from transformers import AutoConfig

    reader = open_gguf(path)
    arch = architecture_of(reader, path)
    with _parsed_once(reader, path):
        try:
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as exc:
            raise ValueError(f"model: cannot read the config of {str(path)!r}: "
                             f"{type(exc).__name__}: {exc}") from None
        if field_value(reader, "tokenizer.ggml.model") is not None:
            _write_tokenizer(path, out)
    config.architectures = [ARCHITECTURES[arch]]
    # transformers leaves a Qwen3 file's head size at the class default (128).
    head_dim = field_value(reader, f"{arch}.attention.key_length")
    if head_dim is not None and hasattr(config, "head_dim"):
        config.head_dim = int(head_dim)
    config.save_pretrained(str(out))
    generation = {k: field_value(reader, f"tokenizer.ggml.{g}")
                  for k, g in (("bos_token_id", "bos_token_id"),
                               ("eos_token_id", "eos_token_id"),
                               ("pad_token_id", "padding_token_id"))}
    for key, name in _SAMPLING_KEYS.items():
        value = field_value(reader, key)
        if value is not None:
            generation[name] = value
    generation.update(sampling)
    (out / "generation_config.json").write_text(
        json.dumps({k: v for k, v in generation.items() if v is not None}, indent=2) + "\n")
    (out / TENSOR_INDEX).write_text(json.dumps(tensor_index(reader, arch)) + "\n")
    (out / GGUF_LINK).symlink_to(path)


# One conversion at a time swaps gguf.GGUFReader (see _parsed_once).
_PARSE_LOCK = threading.Lock()


@contextmanager
def _parsed_once(reader: Any, path: Path) -> Iterator[None]:
    """While open, `gguf.GGUFReader(path)` returns `reader`, already parsed, instead of
    parsing the file again; a reader of any other file, or one asked for with other
    arguments, is constructed as usual.

    transformers' GGUF config loader builds its own reader of the file, and so does its
    tokenizer loader (to pick the tokenizer class from a config); both read the fields and
    tensor names only, so they compute exactly what they would from a fresh parse. They
    look `gguf.GGUFReader` up when called, which is why swapping the module attribute (and
    restoring it, even on error) reaches them; a transformers that stopped doing so would
    just parse the file again (tests/transformers_utils/test_gguf_dir.py counts parses).
    """
    import gguf

    parse = gguf.GGUFReader

    def reuse(file: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and Path(file).resolve() == path:
            return reader
        return parse(file, *args, **kwargs)

    with _PARSE_LOCK:
        gguf.GGUFReader = reuse
        try:
            yield
        finally:
            gguf.GGUFReader = parse


def tensor_index(reader: Any, arch: str) -> dict[str, Any]:
    """The file's architecture and, per tensor, its name, type, and the array GGUFReader maps
    for it (dtype, shape, byte offset), so the loader can map the same bytes alone."""
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    return {
        "architecture": arch,
        # The size of the file's own vocabulary (None without one): a --tokenizer given
        # beside the file must match it.
        "tokenizer_size": None if tokens is None else len(tokens),
        "tensors": [
            {"name": t.name, "type": t.tensor_type.name, "dtype": t.data.dtype.str,
             "shape": [int(n) for n in t.data.shape], "offset": int(t.data_offset),
             "bytes": int(t.n_bytes)}
            for t in reader.tensors
        ],
    }


def _write_tokenizer(path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ValueError(f"tokenizer: cannot build the tokenizer of {str(path)!r} from its "
                         f"metadata ({type(exc).__name__}: {exc}); pass --tokenizer") from None
    tokenizer.save_pretrained(str(out))
