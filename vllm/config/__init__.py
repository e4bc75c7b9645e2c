"""Engine configuration: one VllmConfig made of small, validated parts."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm.attention.kv_cache_dtype import check_kv_cache_dtype
# Re-exported: upstream's code imports it from vllm.config.
from vllm.config.attention import AttentionConfig as AttentionConfig
from vllm.config.multimodal import MultiModalConfig
from vllm.config.parallel import ParallelConfig
from vllm.config.speculative import (
    FAST_FORWARD_TOKENS as FAST_FORWARD_TOKENS,
    MAX_SPECULATIVE_TOKENS as MAX_SPECULATIVE_TOKENS,
    SpeculativeConfig,
)
from vllm.config.structured_outputs import StructuredOutputsConfig
from vllm.options import FCFS, SCHEDULING_POLICIES

logger = logging.getLogger(__name__)

# Upstream vLLM's switch for a --max-model-len above the model's max_position_embeddings.
ALLOW_LONG_MAX_MODEL_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


# Accepted values of --load-format ("hf" reads the Hugging Face safetensors checkpoint, as
# "safetensors" does; "auto" reads a GGUF file where the model is one, else safetensors),
# --tokenizer-mode and --config-format.
LOAD_FORMATS = ("auto", "hf", "safetensors", "gguf", "dummy")
TOKENIZER_MODES = ("auto", "hf", "slow")
# generation_config.json keys that become request defaults, as upstream reads them.
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
CONFIG_FORMATS = ("auto", "hf")


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
    # Hub ids: the branch, tag or commit of the model and of a separate tokenizer, and the
    # hub cache to use instead of HF_HUB_CACHE / HF_HOME.
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    # auto, hf or slow: all load the fast tokenizer, the only kind this engine runs.
    tokenizer_mode: str = "auto"
    # auto or hf: config.json is the only config format read here.
    config_format: str = "auto"
    # --quantization: None follows the checkpoint's quantization_config; a name must agree
    # with it ("fp8" also quantizes a full-precision checkpoint at load).
    quantization: str | None = None
    # --hf-config-path: a directory (or hub id) whose config.json replaces the model's own
    # (upstream's way to give a GGUF file a config its metadata lacks).
    hf_config_path: str | None = None
    # --generation-config: "auto" (the model's generation_config.json gives the sampling
    # defaults of requests that leave a field unset), "vllm" (none), or a directory.
    generation_config: str = "auto"
    # --override-generation-config: sampling defaults (SAMPLING_DEFAULT_KEYS) laid over those
    # of the generation config (alone with generation_config "vllm"); a request's own wins.
    override_generation_config: dict[str, Any] | None = None
    # Resolved in __post_init__.
    model_dir: Path = field(init=False)
    hf_config: Any = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False)
    device: torch.device = field(init=False)
    eos_token_ids: list[int] = field(init=False)
    # The linear layers' quantization (layers/quantization), None for full precision.
    quant_config: Any = field(init=False, repr=False)
    # SamplingParams defaults from the generation config (temperature, top_p, ...).
    sampling_defaults: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        from vllm.transformers_utils.hub import resolve_model_path

        # Checked before anything is downloaded.
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"--load-format: {self.load_format!r} is not one of {', '.join(LOAD_FORMATS)}"
            )
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(
                f"--tokenizer-mode: {self.tokenizer_mode!r} is not supported here; use one of "
                f"{', '.join(TOKENIZER_MODES)} (all load the fast Hugging Face tokenizer)"
            )
        if self.config_format not in CONFIG_FORMATS:
            raise ValueError(
                f"--config-format: {self.config_format!r} is not supported here; use one of "
                f"{', '.join(CONFIG_FORMATS)} (config.json)"
            )
        if self.tokenizer_mode == "slow":
            logger.warning("--tokenizer-mode slow: this engine runs only fast tokenizers; "
                           "loading the fast one")
        # One directory feeds the config, the tokenizer (unless given apart) and the loader.
        self.model_dir = resolve_model_path(
            self.model, field="model", revision=self.revision,
            download_dir=self.download_dir, weights=self.load_format != "dummy")
        if self.tokenizer is None:
            self.tokenizer = str(self.model_dir)
        else:
            self.tokenizer = str(resolve_model_path(
                self.tokenizer, field="tokenizer", revision=self.tokenizer_revision,
                download_dir=self.download_dir, weights=False))
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"--attention-backend: {self.attention_backend!r} is not one of auto, torch, triton"
            )
        config_dir = self.model_dir
        if self.hf_config_path is not None:
            config_dir = resolve_model_path(self.hf_config_path, field="hf_config_path",
                                            revision=self.revision,
                                            download_dir=self.download_dir, weights=False)
        self.hf_config = _load_hf_config(config_dir)
        if self.load_format == "gguf" and self.gguf_file is None:
            raise ValueError(f"--load-format gguf: {self.model!r} is not a GGUF file (nor a "
                             "directory holding one)")
        from vllm.model_executor.layers.quantization import get_quantization_config

        self.quant_config = get_quantization_config(self.hf_config, self.quantization)
        self.device = default_device()
        self.torch_dtype = self._resolve_dtype()
        limit = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        window = sliding_window_of(self.hf_config)
        if window is not None and window < limit and self.max_model_len is None:
            # Attention here has no window: within it, full attention is exact.
            logger.warning("sliding_window %d: max_model_len defaults to it (attention here "
                           "has no window; within it, full attention is the same)", window)
            self.max_model_len = window
        if window is not None and self.max_model_len is not None and self.max_model_len > window:
            raise ValueError(
                f"--max-model-len: {self.max_model_len} exceeds the model's sliding_window "
                f"({window}); attention here has no sliding window, so only contexts up to "
                f"{window} tokens (where full attention is the same) are served: give "
                f"--max-model-len {window} or less"
            )
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len <= 0:
            raise ValueError(f"--max-model-len: must be positive, got {self.max_model_len}")
        elif self.max_model_len > limit:
            if os.environ.get(ALLOW_LONG_MAX_MODEL_LEN_ENV, "").lower() not in ("1", "true"):
                raise ValueError(
                    f"--max-model-len: {self.max_model_len} exceeds the model's "
                    f"max_position_embeddings ({limit}); set {ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 "
                    "to allow it anyway"
                )
            logger.warning(
                "--max-model-len %d exceeds the model's max_position_embeddings (%d); allowed "
                "by %s, but positions past %d were never trained and may give poor output",
                self.max_model_len, limit, ALLOW_LONG_MAX_MODEL_LEN_ENV, limit,
            )
            # The rotary tables must cover every position the engine may schedule.
            self.hf_config.max_position_embeddings = self.max_model_len
        self.eos_token_ids = _load_eos_token_ids(self.model_dir, self.hf_config)
        self.sampling_defaults = self._load_sampling_defaults()
        if self.served_model_name is None:
            self.served_model_name = self.model

    def _resolve_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            # bf16 matmuls are several times slower than fp32 on CPUs without native bf16.
            return torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"--dtype: {self.dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[self.dtype]

    def _load_sampling_defaults(self) -> dict[str, Any]:
        """The generation config's sampling defaults with --override-generation-config laid
        over them. Raises ValueError naming the flag at fault."""
        overrides = _check_generation_overrides(self.override_generation_config)
        # null in an override drops the generation config's value (vLLM's default applies).
        merged = {**self._read_generation_config(), **overrides}
        return {k: v for k, v in merged.items() if v is not None}

    def _read_generation_config(self) -> dict[str, Any]:
        if self.generation_config == "vllm":
            return {}
        directory = (self.model_dir if self.generation_config == "auto"
                     else Path(self.generation_config).expanduser())
        path = directory / "generation_config.json"
        if not path.is_file():
            if self.generation_config != "auto":
                raise ValueError(f"--generation-config: {str(path)!r} does not exist (use "
                                 "auto, vllm or a directory holding generation_config.json)")
            return {}
        try:
            config = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"--generation-config: malformed {str(path)!r}: {e}") from None
        # do_sample false means greedy in transformers, whatever temperature says.
        if config.get("do_sample") is False:
            config = {k: v for k, v in config.items() if k not in ("temperature", "top_p",
                                                                    "top_k", "min_p")}
        return {k: config[k] for k in SAMPLING_DEFAULT_KEYS if config.get(k) is not None}

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def gguf_file(self) -> Path | None:
        """The GGUF file the weights are read from, None for a safetensors checkpoint."""
        from vllm.transformers_utils.gguf_dir import find_gguf

        return find_gguf(self.model_dir)


def sliding_window_of(hf_config: Any) -> int | None:
    """The sliding attention window a model's config asks for, None when its layers attend
    to every earlier position (no `sliding_window`, `use_sliding_window` false, or no layer
    of `layer_types` a sliding one). Query i sees key j when i - j < window."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _check_generation_overrides(overrides: object) -> dict[str, Any]:
    """--override-generation-config as sampling defaults: a JSON object whose keys are among
    SAMPLING_DEFAULT_KEYS and whose values SamplingParams accepts. Raises ValueError naming
    the flag (and the key) otherwise, so that no request fails later for the operator's
    mistake and no key is silently dropped."""
    flag = "--override-generation-config"
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise ValueError(f"{flag}: must be a JSON object, got {overrides!r}")
    unknown = sorted(set(overrides) - set(SAMPLING_DEFAULT_KEYS))
    if unknown:
        raise ValueError(
            f"{flag}: {', '.join(map(repr, unknown))} not supported here; only the sampling "
            f"defaults {', '.join(SAMPLING_DEFAULT_KEYS)} can be set (a request's own value "
            "still wins)"
        )
    from vllm.sampling_params import SamplingParams

    try:
        SamplingParams(**{k: v for k, v in overrides.items() if v is not None})
    except ValueError as e:
        raise ValueError(f"{flag}.{e}") from None
    return dict(overrides)


def _load_hf_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"model: {model_dir} has no config.json")
    try:
        json.loads(path.read_text())
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # malformed JSON, unknown model_type, missing fields
        raise ValueError(f"model: malformed config.json in {model_dir}: {e}") from e
    from vllm.config.multimodal import flatten_vl_config

    # A vision-language config runs as its text config, with the vision part beside it.
    return flatten_vl_config(config)


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
    # --kv-cache-dtype: "auto" (the model's dtype) or "fp8"/"fp8_e4m3" (see
    # vllm/attention/kv_cache_dtype.py); a smaller element fits more blocks in the budget.
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.cache_dtype)
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
    # --scheduling-policy: "fcfs" or "priority" (vllm.options.SCHEDULING_POLICIES).
    policy: str = FCFS

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs: must be at least 1, got {self.max_num_seqs}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"--scheduling-policy: must be one of "
                             f"{', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
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
class LoRAConfig:
    """LoRA adapters (CLI: `--enable-lora --max-loras --max-lora-rank --max-cpu-loras`).

    `max_loras` adapters can run in one step (each holds a slot of stacked weights in every
    targeted layer); `max_cpu_loras` loaded adapters are kept on the host, least recently
    used evicted first; every adapter's rank must be at most `max_lora_rank`.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    # None: max_loras.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if name == "max_cpu_loras" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag}: must be a positive integer, got {value!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                f"({self.max_loras})"
            )


# Architectures whose linear layers take adapters (dense Llama-family decoders).
LORA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                      "Qwen3ForCausalLM")


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
    speculative_config: SpeculativeConfig | None = None
    # None: LoRA adapters are off (--enable-lora turns them on).
    lora_config: LoRAConfig | None = None
    # Images in prompts (limits; used with vision-language models).
    multimodal_config: MultiModalConfig = field(default_factory=MultiModalConfig)

    def __post_init__(self) -> None:
        self.scheduler_config.max_model_len = self.model_config.max_model_len
        self.multimodal_config.verify(self)
        if self.lora_config is not None:
            self._verify_lora()
        # The layout is checked in full before any process starts.
        self.parallel_config.verify_with_model_config(self.model_config)
        self.parallel_config.verify_devices(self.model_config.device)
        if self.speculative_config is not None:
            self.speculative_config.verify_with_target(self.model_config, self.parallel_config)

    def _verify_lora(self) -> None:
        """Raises ValueError for a setup LoRA adapters do not run under."""
        archs = list(getattr(self.model_config.hf_config, "architectures", None) or [])
        if not any(a in LORA_ARCHITECTURES for a in archs):
            raise ValueError(
                f"--enable-lora: architecture {archs} takes no adapters; supported: "
                f"{', '.join(LORA_ARCHITECTURES)}"
            )

    @property
    def max_concurrent_batches(self) -> int:
        """Depth of the engine core's batch queue (docs/architecture.md §4): one batch per
        pipeline stage keeps every stage busy, and async scheduling needs at least 2 (the
        next batch is scheduled while one is on the device). 1 runs the synchronous step."""
        stages = self.parallel_config.pipeline_parallel_size
        if self.scheduler_config.async_scheduling:
            return max(2, stages)
        return stages

    def scheduling_mode(self) -> str:
        """One line for the startup log saying which scheduling mode runs and how to switch."""
        if self.scheduler_config.async_scheduling:
            return ("async scheduling: on (step N+1 is scheduled while step N runs; "
                    "--no-async-scheduling turns it off)")
        return "async scheduling: off (synchronous steps; --async-scheduling turns it on)"

    @property
    def num_speculative_tokens(self) -> int:
        """Most drafted tokens per request and step (0 without speculative decoding)."""
        spec = self.speculative_config
        return spec.num_speculative_tokens if spec is not None else 0

