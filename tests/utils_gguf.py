"""Tiny GGUF files written with the `gguf` package's own writer, for the loader's oracles."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Shapes that every block size divides (the K-quants pack 256 columns per block).
SIZES = dict(vocab=512, hidden=256, ffn=512, layers=2, heads=2, kv_heads=1, head_dim=128)
# Five words and the merges that build them, for a tokenizer in the file's metadata.
WORDS = ["hello", "world", "json", "name", "age"]


def _random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype) -> np.ndarray:
    """Random packed rows of a block type. Every byte stays below 32, so every half-float
    scale a block holds, wherever it sits in the block, is finite and below 1/64 (weights
    of a usual size)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 32, size=(rows, cols // block * size), dtype=np.uint8)


def _tensor(rng: np.random.Generator, shape: tuple[int, ...], qtype):
    """(data, raw_dtype) of one tensor of `shape` (rows, cols) in type `qtype`."""
    import gguf

    T = gguf.GGMLQuantizationType
    values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    if len(shape) == 1:
        return (1.0 + values).astype(np.float32), None  # norms stay F32, as llama.cpp keeps them
    if qtype == T.F32:
        return values, None
    if qtype == T.F16:
        return values.astype(np.float16), None
    try:
        return gguf.quants.quantize(values, qtype), qtype
    except NotImplementedError:  # the package packs only some types (no K-quants)
        return _random_blocks(rng, shape[0], shape[1], qtype), qtype


def write_gguf(path: Path, arch: str = "llama", qtype_name: str = "Q8_0", seed: int = 0,
               tokenizer: bool = True, extra_tensor: tuple[str, str] | None = None) -> Path:
    """Writes a tiny random `arch` model (llama, qwen2 or qwen3) whose matrices are stored as
    `qtype_name`, with a tiny GPT-2 style tokenizer and ChatML template in its metadata
    when `tokenizer`. `extra_tensor` (name, type) adds one more 2-D tensor. Returns `path`."""
    import gguf

    T = gguf.GGMLQuantizationType
    qtype = T[qtype_name]
    s = SIZES
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(s["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(s["vocab"])
    if tokenizer:
        _add_tokenizer(writer, s["vocab"])
    q_rows = s["heads"] * s["head_dim"]
    kv_rows = s["kv_heads"] * s["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (s["vocab"], s["hidden"]),
        "output_norm.weight": (s["hidden"],),
        "output.weight": (s["vocab"], s["hidden"]),
    }
    for i in range(s["layers"]):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": (s["hidden"],),
            b + "attn_q.weight": (q_rows, s["hidden"]),
            b + "attn_k.weight": (kv_rows, s["hidden"]),
            b + "attn_v.weight": (kv_rows, s["hidden"]),
            b + "attn_output.weight": (s["hidden"], q_rows),
            b + "ffn_norm.weight": (s["hidden"],),
            b + "ffn_gate.weight": (s["ffn"], s["hidden"]),
            b + "ffn_up.weight": (s["ffn"], s["hidden"]),
            b + "ffn_down.weight": (s["hidden"], s["ffn"]),
        }
        if arch == "qwen2":
            for name, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                shapes[b + name + ".bias"] = (rows,)
        if arch == "qwen3":
            shapes[b + "attn_q_norm.weight"] = (s["head_dim"],)
            shapes[b + "attn_k_norm.weight"] = (s["head_dim"],)
    for name, shape in shapes.items():
        data, raw = _tensor(rng, shape, qtype)
        if name.endswith(".bias"):
            data = (data - 1.0).astype(np.float32)
        writer.add_tensor(name, data, raw_dtype=raw)
    if extra_tensor is not None:
        name, kind = extra_tensor
        data, raw = _tensor(rng, (4, 256), T[kind])
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer, vocab: int) -> None:
    letters = sorted({c for w in WORDS for c in w} | set(" {}\":,0123456789"))
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [c if c != " " else "Ġ" for c in letters]
    merges = []
    for word in WORDS:
        for end in range(2, len(word) + 1):
            left, right = word[: end - 1], word[end - 1]
            if word[:end] not in tokens:
                merges.append(f"{left} {right}")
                tokens.append(word[:end])
    tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
