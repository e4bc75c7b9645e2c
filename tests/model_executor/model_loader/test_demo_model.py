"""Tests for vllm/model_executor/model_loader/demo_model.py (demo-tiny only: it is cheap)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from vllm.model_executor.model_loader import demo_model, demos
from vllm.model_executor.model_loader.demo_model import (
    BUILD_VERSION,
    DEMO_MODELS,
    build_demo_model,
)
from vllm.model_executor.model_loader.demos import resolve_model_dir

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tiny_dir(cache_root: Path) -> Path:
    return build_demo_model("demo-tiny", cache_root)


def test_specs() -> None:
    demo, tiny = DEMO_MODELS["demo"], DEMO_MODELS["demo-tiny"]
    assert (demo.hidden_size, demo.num_hidden_layers, demo.num_attention_heads) == (256, 4, 4)
    assert (demo.head_dim, demo.num_key_value_heads, demo.intermediate_size) == (64, 2, 768)
    assert (tiny.hidden_size, tiny.num_hidden_layers, tiny.num_attention_heads) == (64, 2, 4)
    assert (tiny.head_dim, tiny.num_key_value_heads, tiny.intermediate_size) == (16, 2, 128)


def test_layout(tiny_dir: Path, cache_root: Path) -> None:
    assert tiny_dir == cache_root / "demo-models" / f"demo-tiny-{BUILD_VERSION}"
    names = {p.name for p in tiny_dir.iterdir()}
    expected = {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    }
    assert expected <= names
    # No leftover temporary build directories.
    assert [p.name for p in (cache_root / "demo-models").iterdir()] == [f"demo-tiny-{BUILD_VERSION}"]


def test_config_loads(tiny_dir: Path) -> None:
    cfg = transformers.AutoConfig.from_pretrained(tiny_dir)
    assert cfg.model_type == "qwen3" and cfg.architectures == ["Qwen3ForCausalLM"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 2, 4)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.intermediate_size) == (16, 2, 128)
    assert cfg.vocab_size == 151936 and cfg.tie_word_embeddings
    assert cfg.max_position_embeddings == 4096 and cfg.rms_norm_eps == 1e-6
    assert cfg.eos_token_id == 151645 and cfg.pad_token_id == 151643 and cfg.bos_token_id is None
    raw = json.loads((tiny_dir / "config.json").read_text())
    assert raw["rope_theta"] == 1e6 and raw["torch_dtype"] == "float32"
    gen = transformers.GenerationConfig.from_pretrained(tiny_dir)
    assert list(gen.eos_token_id) == [151645, 151643]
    tok_cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and tok_cfg["pad_token"] == "<|endoftext|>"
    assert tok_cfg["bos_token"] is None and "add_generation_prompt" in tok_cfg["chat_template"]


def test_weights_match_hf_model(tiny_dir: Path) -> None:
    cfg = transformers.AutoConfig.from_pretrained(tiny_dir)
    with torch.device("meta"):
        reference = transformers.Qwen3ForCausalLM(cfg)
    expected = {
        k: tuple(v.shape) for k, v in reference.state_dict().items() if k != "lm_head.weight"
    }
    with safe_open(str(tiny_dir / "model.safetensors"), framework="pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        embed = f.get_tensor("model.embed_tokens.weight")
        norm = f.get_tensor("model.norm.weight")
    assert stored == expected
    assert embed.dtype == torch.float32
    random_part = embed[:, :-1]  # the last column is the tilt's constant channel
    assert 0.015 < random_part.std().item() < 0.025 and abs(random_part.mean().item()) < 1e-3
    assert (norm - 1).abs().max().item() < 0.1 and norm.std().item() > 0

    model, info = transformers.Qwen3ForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(model.lm_head.weight, embed)  # tied to the embedding
    assert torch.equal(model.model.embed_tokens.weight, embed)
    with torch.no_grad():
        logits = model(torch.tensor([[9707, 1879]])).logits
    assert logits.shape == (1, 2, 151936) and torch.isfinite(logits).all()


def test_weights_are_seeded() -> None:
    spec = DEMO_MODELS["demo-tiny"]
    a, b = demo_model.random_weights(spec), demo_model.random_weights(spec)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cache_hit_builds_nothing(tiny_dir: Path, cache_root: Path, monkeypatch) -> None:
    before = (tiny_dir / "model.safetensors").stat()

    def no_build(*args, **kwargs):
        raise AssertionError("a cache hit must not build weights again")

    monkeypatch.setattr(demo_model, "random_weights", no_build)
    again = build_demo_model("demo-tiny", cache_root)
    assert again == tiny_dir
    after = (tiny_dir / "model.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_concurrent_builds(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path;"
        "from vllm.model_executor.model_loader.demo_model import build_demo_model;"
        "print(build_demo_model('demo-tiny', Path(sys.argv[1])))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
    final = tmp_path / "demo-models" / f"demo-tiny-{BUILD_VERSION}"
    assert [out.strip() for out, _ in results] == [str(final)] * 2
    assert [p.name for p in (tmp_path / "demo-models").iterdir()] == [f"demo-tiny-{BUILD_VERSION}"]
    cfg = transformers.AutoConfig.from_pretrained(final)
    assert cfg.hidden_size == 64


def test_losing_the_race_uses_the_winner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Another process finishes its build while ours runs: ours is discarded, theirs used.
    final = demo_model.model_dir("demo-tiny", tmp_path)

    def slow_write(path: Path, spec: demo_model.DemoModelSpec) -> None:
        (path / "config.json").write_text("{}")
        final.mkdir(parents=True)
        (final / "config.json").write_text('{"winner": true}')

    monkeypatch.setattr(demo_model, "_write_model", slow_write)
    assert build_demo_model("demo-tiny", tmp_path) == final
    assert json.loads((final / "config.json").read_text()) == {"winner": True}
    assert [p.name for p in final.parent.iterdir()] == [f"demo-tiny-{BUILD_VERSION}"]


def test_failed_build_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broken_write(path: Path, spec: demo_model.DemoModelSpec) -> None:
        (path / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(demo_model, "_write_model", broken_write)
    with pytest.raises(OSError, match="disk full"):
        build_demo_model("demo-tiny", tmp_path)
    assert list((tmp_path / "demo-models").iterdir()) == []


def test_resolve_model_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    built: list[str] = []

    def fake_build(name: str = "demo", cache_root: Path | None = None) -> Path:
        built.append(name)
        return tmp_path / name

    monkeypatch.setattr(demos, "build_demo_model", fake_build)
    assert resolve_model_dir(None) == tmp_path / "demo"
    assert resolve_model_dir("") == tmp_path / "demo"
    assert resolve_model_dir("demo-tiny") == tmp_path / "demo-tiny"
    assert built == ["demo", "demo", "demo-tiny"]
    assert resolve_model_dir("~/models/x") == Path.home() / "models" / "x"
    assert resolve_model_dir("/abs/path") == Path("/abs/path")
    assert built == ["demo", "demo", "demo-tiny"]


def test_cache_root_from_env(
    monkeypatch: pytest.MonkeyPatch, tiny_dir: Path, cache_root: Path
) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(cache_root))
    assert resolve_model_dir("demo-tiny") == tiny_dir
    monkeypatch.delenv("VLLM_CACHE_ROOT")
    assert demo_model.default_cache_root() == Path.home() / ".cache" / "vllm"


def test_unknown_name(cache_root: Path) -> None:
    with pytest.raises(ValueError, match="not a demo model"):
        build_demo_model("demo-huge", cache_root)
