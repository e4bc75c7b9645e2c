"""Tests for vllm/transformers_utils/gguf_dir.py: converting a GGUF file parses its metadata
once, and what the conversion writes is what transformers builds from the file itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils_gguf import write_gguf
from vllm.transformers_utils.gguf_dir import gguf_model_dir


def _count_parses(monkeypatch) -> list[Path]:
    """Records the file of every gguf.GGUFReader that really parses one from now on."""
    import gguf

    parsed: list[Path] = []
    init = gguf.GGUFReader.__init__

    def counting(self, path, *args, **kwargs) -> None:
        parsed.append(Path(path).resolve())
        init(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting)
    return parsed


def test_conversion_parses_the_file_once_and_equals_transformers(tmp_path, monkeypatch):
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    path = write_gguf(tmp_path / "m.gguf", "qwen3", "Q8_0")
    reader_class = gguf.GGUFReader
    parsed = _count_parses(monkeypatch)
    model_dir = gguf_model_dir(path, cache_root=tmp_path / "cache")
    # Ours, transformers' config and its tokenizer (which builds a config too) all read it.
    assert parsed == [path.resolve()]
    assert gguf.GGUFReader is reader_class
    # transformers' own loads of the file, each parsing it afresh.
    want = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).to_dict()
    got = AutoConfig.from_pretrained(str(model_dir)).to_dict()
    assert len(parsed) > 1
    # Where each was loaded from, and the model class the conversion names on purpose.
    for config in (got, want):
        config.pop("_name_or_path")
    assert got.pop("architectures") == ["Qwen3ForCausalLM"]
    want.pop("architectures", None)
    assert got == want
    # The tokenizer files are those transformers' own tokenizer of the file saves.
    want_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    want_tok.save_pretrained(str(tmp_path / "want"))
    names = sorted(p.name for p in (tmp_path / "want").iterdir())
    assert "tokenizer.json" in names and "chat_template.jinja" in names
    for name in names:
        assert (model_dir / name).read_bytes() == (tmp_path / "want" / name).read_bytes(), name


def test_failed_conversion_restores_the_reader(tmp_path, monkeypatch):
    import gguf
    import transformers

    def broken(*args, **kwargs):
        raise RuntimeError("no tokenizer today")

    path = write_gguf(tmp_path / "m.gguf", "llama", "F32")
    reader_class = gguf.GGUFReader
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", broken)
    with pytest.raises(ValueError, match="tokenizer: .*no tokenizer today"):
        gguf_model_dir(path, cache_root=tmp_path / "cache")
    assert gguf.GGUFReader is reader_class
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # nothing half-written is kept
