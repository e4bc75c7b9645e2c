"""A V1-shaped LLM serving engine where async scheduling and structured outputs work together."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# OpenMP threads that spin between parallel regions (libgomp's default) starve the engine's
# other threads and processes of the CPU: measured 305 -> 622 tok/s on the demo model with 2
# cores. libgomp reads this when torch first loads it, so it must be set before torch imports.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineArgs",
]

if TYPE_CHECKING:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.llm import LLM
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    # Lazy so that `import vllm` (e.g. for the CLI's --help) does not import torch.
    if name == "LLM":
        from vllm.entrypoints.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from vllm import sampling_params

        return getattr(sampling_params, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from vllm import outputs

        return getattr(outputs, name)
    if name == "EngineArgs":
        from vllm.engine.arg_utils import EngineArgs

        return EngineArgs
    raise AttributeError(name)
