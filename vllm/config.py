"""Engine configuration: one VllmConfig made of small, validated parts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def default_device() -> torch.device:
    """The device the engine runs on: CUDA when present, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class ModelConfig:
    """What model to run and how to load it."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    load_format: str = "auto"
    enforce_eager: bool = False
    attention_backend: str = "auto"
    served_model_name: str | None = None
    # Resolved in __post_init__.
    model_dir: Path = field(init=False)
    hf_config: Any = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False)
    device: torch.device = field(init=False)
    eos_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        from vllm.model_executor.model_loader.demo_model import resolve_model_dir

        self.model_dir = resolve_model_dir(self.model)
        if not self.model_dir.is_dir():
            raise ValueError(f"model: directory {self.model!r} does not exist")
        if self.tokenizer is None:
            self.tokenizer = str(self.model_dir)
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(
                f"--load-format: {self.load_format!r} is not one of auto, safetensors, dummy"
            )
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"--attention-backend: {self.attention_backend!r} is not one of auto, torch, triton"
            )
        self.hf_config = _load_hf_config(self.model_dir)
        self.device = default_device()
        self.torch_dtype = self._resolve_dtype()
        limit = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len <= 0:
            raise ValueError(f"--max-model-len: must be positive, got {self.max_model_len}")
        elif self.max_model_len > limit:
            raise ValueError(
                f"--max-model-len: {self.max_model_len} exceeds the model's "
                f"max_position_embeddings ({limit})"
            )
        self.eos_token_ids = _load_eos_token_ids(self.model_dir, self.hf_config)
        if self.served_model_name is None:
            self.served_model_name = self.model

    def _resolve_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            # bf16 matmuls are several times slower than fp32 on CPUs without native bf16.
            return torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"--dtype: {self.dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[self.dtype]

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


def _load_hf_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"model: {model_dir} has no config.json")
    try:
        json.loads(path.read_text())
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # malformed JSON, unknown model_type, missing fields
        raise ValueError(f"model: malformed config.json in {model_dir}: {e}") from e


def _load_eos_token_ids(model_dir: Path, hf_config: Any) -> list[int]:
    ids: list[int] = []
    gen = model_dir / "generation_config.json"
    candidates = []
    if gen.is_file():
        candidates.append(json.loads(gen.read_text()).get("eos_token_id"))
    candidates.append(getattr(hf_config, "eos_token_id", None))
    for c in candidates:
        for i in c if isinstance(c, list) else [c]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


@dataclass
class CacheConfig:
    """Paged KV cache shape and size."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    # Bytes for the KV cache on CPU; None picks a default from max_model_len and max_num_seqs.
    kv_cache_memory: int | None = None
    # Fraction of GPU memory the engine may use (CUDA only).
    gpu_memory_utilization: float = 0.9
    # Overrides the computed number of blocks (tests use it to force preemption).
    num_gpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"--block-size: must be a power of two up to 128, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"--gpu-memory-utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory: must be positive, got {self.kv_cache_memory}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("--num-gpu-blocks-override: must be at least 1")


@dataclass
class SchedulerConfig:
    """How many requests and tokens one step may hold."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int = 2048
    async_scheduling: bool = False
    # Most sequences one request may ask for (n, times the prompts of a batched completion):
    # each costs front-end work and memory before the engine can push back.
    max_n: int = 128

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs: must be at least 1, got {self.max_num_seqs}")
        if self.max_n < 1:
            raise ValueError(f"--max-n: must be at least 1, got {self.max_n}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(2048, self.max_num_seqs)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
                f"--max-num-seqs ({self.max_num_seqs}) so every running decode fits in a step"
            )


@dataclass
class ParallelConfig:
    """Where the workers run."""

    distributed_executor_backend: str = "uni"
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.distributed_executor_backend not in ("uni", "mp"):
            raise ValueError(
                "--distributed-executor-backend: must be 'uni' or 'mp', got "
                f"{self.distributed_executor_backend!r}"
            )


@dataclass
class StructuredOutputsConfig:
    """Structured-output backend options."""

    backend: str = "xgrammar"
    # Seconds a grammar may take to compile before its request fails.
    compile_timeout_s: float = 10.0
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "xgrammar"):
            raise ValueError(
                f"--structured-outputs-config.backend: {self.backend!r} is not one of auto, xgrammar"
            )
        if self.compile_timeout_s <= 0:
            raise ValueError("--structured-outputs-config.compile_timeout_s: must be positive")


@dataclass
class VllmConfig:
    """Everything the engine needs, checked once at startup."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig
    )

    def __post_init__(self) -> None:
        self.scheduler_config.max_model_len = self.model_config.max_model_len

    @property
    def max_concurrent_batches(self) -> int:
        """Batches in flight: 2 under async scheduling, else 1."""
        return 2 if self.scheduler_config.async_scheduling else 1
