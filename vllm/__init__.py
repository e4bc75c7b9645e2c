"""A V1-shaped LLM serving engine where async scheduling and structured outputs work together."""

from __future__ import annotations

from typing import TYPE_CHECKING

# Importing vllm changes nothing in the process: thread and OpenMP settings are applied where
# engine processes start (see vllm.thread_policy).

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
