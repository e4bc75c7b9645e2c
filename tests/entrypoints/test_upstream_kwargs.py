"""Upstream vLLM's LLM(...) keyword arguments and engine flags, as its own tests and examples
pass them: supported ones work, those with no purpose here are accepted with one warning,
unsupported values are refused naming the option."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from vllm import LLM, SamplingParams
from vllm.config import StructuredOutputsConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import StructuredOutputsParams

MODEL = "demo-tiny"


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    # Spelled as upstream's tests build an engine (only the model name differs).
    engine = LLM(
        model=MODEL,
        tokenizer_mode="auto",
        config_format="auto",
        load_format="hf",
        trust_remote_code=True,
        enforce_eager=True,
        seed=0,
        max_model_len=256,
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
        disable_log_stats=True,
        swap_space=0,
        gpu_memory_utilization=0.5,
        structured_outputs_config=StructuredOutputsConfig(backend="xgrammar"),
        attention_config={"backend": "TORCH_SDPA"},
    )
    try:
        yield engine
    finally:
        engine.shutdown()


def test_upstream_style_llm_generates(llm: LLM) -> None:
    config = llm.llm_engine.vllm_config
    assert config.structured_outputs_config.backend == "xgrammar"
    assert config.model_config.attention_backend == "torch"  # attention_config's TORCH_SDPA
    # max_num_batched_tokens below the default max_num_seqs lowers it instead of failing.
    assert config.scheduler_config.max_num_seqs == 64
    assert config.scheduler_config.max_num_batched_tokens == 64
    params = SamplingParams(
        temperature=0.0, max_tokens=12,
        structured_outputs=StructuredOutputsParams(regex="[0-9]{4}"))
    # A prompt longer than the step budget is chunked (chunked prefill is honoured).
    out = llm.generate(["word " * 100], params, use_tqdm=False)[0].outputs[0]
    assert len(out.text) == 4 and out.text.isdigit()


def test_get_tokenizer(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


def _config(**kwargs):
    return EngineArgs(model=MODEL, **kwargs).create_engine_config()


def test_structured_outputs_config_as_dict_or_object() -> None:
    as_dict = _config(structured_outputs_config={"backend": "guidance"})
    assert as_dict.structured_outputs_config.backend == "guidance"
    as_object = _config(
        structured_outputs_config=StructuredOutputsConfig(backend="guidance",
                                                          disable_any_whitespace=True),
        reasoning_parser="qwen3")
    so = as_object.structured_outputs_config
    assert (so.backend, so.disable_any_whitespace, so.reasoning_parser) == (
        "guidance", True, "qwen3")
    with pytest.raises(ValueError, match="--structured-outputs-config: must be a JSON object"):
        _config(structured_outputs_config="xgrammar")


def test_attention_config_as_dict_or_object() -> None:
    import enum

    from vllm.config import AttentionConfig

    class Backend(enum.Enum):  # upstream passes its AttentionBackendEnum members
        TRITON_ATTN = 1

    def backend(config: object, **kwargs) -> str:
        return _config(attention_config=config, **kwargs).model_config.attention_backend

    assert backend(AttentionConfig(backend="CPU_ATTN")) == "torch"
    assert backend({"backend": Backend.TRITON_ATTN}) == "triton"
    assert backend({"backend": None, "flash_attn_version": None}) == "auto"  # asks nothing
    assert backend({"backend": "auto"}, attention_backend="torch") == "torch"
    for config, message in [
        ({"backend": "FLASH_ATTN"}, "attention_config.backend: 'FLASH_ATTN' is not available"),
        ({"use_cudnn_prefill": True}, "attention_config.use_cudnn_prefill: True is not"),
        ({"backends": "triton"}, "attention_config.backends: unknown option"),
        ("triton", "attention_config: must be a dict"),
    ]:
        with pytest.raises(ValueError, match=message):
            backend(config)
    with pytest.raises(ValueError, match="attention_config.backend 'triton_attn' and "
                                         "--attention-backend torch disagree"):
        backend({"backend": "triton_attn"}, attention_backend="torch")


@pytest.mark.parametrize("mode", ["auto", "hf", "slow"])
def test_tokenizer_modes_accepted(mode: str) -> None:
    assert _config(tokenizer_mode=mode).model_config.tokenizer_mode == mode


@pytest.mark.parametrize("kwargs, flag", [
    ({"tokenizer_mode": "mistral"}, "--tokenizer-mode: 'mistral'"),
    ({"config_format": "mistral"}, "--config-format: 'mistral'"),
    ({"load_format": "pt"}, "--load-format: 'pt'"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "--kv-cache-dtype: 'fp8_e5m2'"),
])
def test_unsupported_values_name_the_option(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        _config(**kwargs)


@pytest.mark.parametrize("fmt", ["auto", "hf", "safetensors", "dummy"])
def test_load_formats_accepted(fmt: str) -> None:
    assert _config(load_format=fmt).model_config.load_format == fmt


def test_max_num_batched_tokens_lowers_only_the_default_max_num_seqs() -> None:
    assert _config(max_num_batched_tokens=32).scheduler_config.max_num_seqs == 32
    assert _config(max_num_batched_tokens=4096).scheduler_config.max_num_seqs == 256
    assert _config().scheduler_config.max_num_seqs == 256
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        _config(max_num_batched_tokens=32, max_num_seqs=64)


@pytest.mark.parametrize("kwargs, option", [
    ({"enable_chunked_prefill": False}, "enable_chunked_prefill"),
    ({"disable_log_stats": True}, "disable_log_stats"),
    ({"swap_space": 4}, "swap_space"),
])
def test_no_effect_options_warn_once(
    kwargs: dict, option: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.engine.arg_utils"):
        _config(**kwargs)
    warnings = [r.getMessage() for r in caplog.records if option in r.getMessage()]
    assert len(warnings) == 1 and "no effect" in warnings[0]


def test_defaults_warn_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.engine.arg_utils"):
        _config(enable_chunked_prefill=True)
    assert not caplog.records
