"""Which `--model` values name a demo model, and where each resolves: the default demo
family (demo_model.py), the small-vocabulary bodies (demo_small_vocab.py) and the scripted
model (demo_scripted.py). The one module that knows all three, so none of them imports
another's resolver."""

from __future__ import annotations

from pathlib import Path

from vllm.model_executor.model_loader import demo_scripted, demo_small_vocab
from vllm.model_executor.model_loader.demo_model import DEFAULT_MODEL, DEMO_MODELS, build_demo_model


def resolve_model_dir(model: str | None) -> Path:
    """Map a `--model` value to a directory: None, "" or a demo name → the built demo model.

    Anything else is taken as a local path (not checked here). Raises what
    `build_demo_model` raises.
    """
    if not model:
        return build_demo_model(DEFAULT_MODEL)
    if model in DEMO_MODELS:
        return build_demo_model(model)
    small = demo_small_vocab.resolve(model)
    if small is not None:
        return small
    scripted = demo_scripted.resolve(model)
    if scripted is not None:
        return scripted
    return Path(model).expanduser()


def serves_compact_json(model: str | None) -> bool:
    """Whether `--model` value `model` names a demo model whose spec asks for compact JSON
    by default (None or "" is the default demo model). False for anything else: a path or
    hub id keeps upstream's default. Builds nothing."""
    if not model:
        model = DEFAULT_MODEL
    elif Path(model).expanduser().is_dir():
        return False  # a local directory wins over a demo name (ModelConfig's order)
    if model == demo_scripted.NAME:
        model = demo_scripted.BODY
    spec = DEMO_MODELS.get(model) or demo_small_vocab.SMALL_VOCAB_MODELS.get(model)
    return spec is not None and spec.compact_json
