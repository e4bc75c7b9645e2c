"""Tests for vllm/engine/arg_utils.py and the flag spellings of the `vllm` command line
(vllm/utils/argparse_utils.py, vllm/entrypoints/cli/arg_parser.py): upstream vLLM's commands parse as written, unknown flags
are refused by name, and parallel layouts are checked before anything starts."""

from __future__ import annotations

import argparse

import pytest
import torch

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli.arg_parser import prepare_argv
from vllm.entrypoints.cli.main import discover_subcommands, main, make_parser
from vllm.utils.argparse_utils import (
    FlexibleArgumentParser,
    normalize_flag_spellings,
    unknown_arguments_message,
)

MODEL = "demo-tiny"

# The server command of the upstream report (issue 17), after `--model MODEL`.
UPSTREAM_SERVE_FLAGS = (
    "--enforce-eager --port 8000 --host 0.0.0.0 -pp 2 --distributed_executor_backend=mp "
    "--trust-remote-code --gpu-memory-util=0.9 --no-enable-prefix-caching "
    "--max-num-batched-tokens=8192 --disable-log-requests --max-model-len=8192 --block-size 64 "
    "--dtype=float16 -tp=2"
).split()


def parse(*argv: str) -> argparse.Namespace:
    """`vllm ARGV` parsed as main() parses it."""
    return make_parser(discover_subcommands()).parse_args(prepare_argv(list(argv)))


def serve_args(*flags: str) -> EngineArgs:
    """EngineArgs of `vllm serve demo-tiny FLAGS`."""
    return EngineArgs.from_cli_args(parse("serve", MODEL, *flags))


def test_upstream_report_command_parses() -> None:
    args = parse("serve", "--model", MODEL, *UPSTREAM_SERVE_FLAGS)
    assert args.model == MODEL and args.model_tag is None
    assert (args.host, args.port, args.disable_log_requests) == ("0.0.0.0", 8000, True)
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.tensor_parallel_size == 2
    assert engine_args.pipeline_parallel_size == 2
    assert engine_args.distributed_executor_backend == "mp"
    assert engine_args.trust_remote_code is True
    assert engine_args.gpu_memory_utilization == 0.9
    assert engine_args.enforce_eager is True
    assert engine_args.enable_prefix_caching is False
    assert engine_args.max_num_batched_tokens == 8192
    assert engine_args.max_model_len == 8192
    assert engine_args.block_size == 64
    assert engine_args.dtype == "float16"


@pytest.mark.parametrize("flags", [
    ["-tp", "2"], ["-tp=2"], ["--tensor-parallel-size", "2"], ["--tensor-parallel-size=2"],
    ["--tensor_parallel_size", "2"], ["--tensor_parallel_size=2"],
])
def test_tensor_parallel_spellings(flags: list[str]) -> None:
    assert serve_args(*flags).tensor_parallel_size == 2


@pytest.mark.parametrize("flags", [
    ["-pp", "2"], ["-pp=2"], ["--pipeline-parallel-size", "2"], ["--pipeline_parallel_size=2"],
])
def test_pipeline_parallel_spellings(flags: list[str]) -> None:
    assert serve_args(*flags).pipeline_parallel_size == 2


@pytest.mark.parametrize("flags", [
    ["--distributed-executor-backend", "mp"], ["--distributed-executor-backend=mp"],
    ["--distributed_executor_backend=mp"], ["--distributed_executor_backend", "mp"],
])
def test_executor_backend_spellings(flags: list[str]) -> None:
    assert serve_args(*flags).distributed_executor_backend == "mp"


def test_prefixes_and_underscores_of_any_flag() -> None:
    # argparse's allow_abbrev (inherited by the subcommand parsers) resolves prefixes.
    assert serve_args("--gpu-memory-util=0.5").gpu_memory_utilization == 0.5
    assert serve_args("--gpu_memory_util", "0.5").gpu_memory_utilization == 0.5
    assert serve_args("--max_model_len=128").max_model_len == 128
    assert serve_args("--no_enable_prefix_caching").enable_prefix_caching is False
    assert serve_args("--trust_remote_code").trust_remote_code is True
    assert parse("serve", "--disable_log_requests").disable_log_requests is True


def test_defaults_leave_the_layout_to_the_config() -> None:
    args = serve_args()
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (1, 1)
    assert args.distributed_executor_backend is None
    assert args.trust_remote_code is False


def test_normalize_touches_only_long_flag_names() -> None:
    argv = ["--max_model_len=a_b", "-tp=2", "--served-model-name", "my_model", "x_y",
            "--", "--not_a_flag"]
    assert normalize_flag_spellings(argv) == [
        "--max-model-len=a_b", "-tp=2", "--served-model-name", "my_model", "x_y",
        "--", "--not_a_flag",
    ]


def test_dotted_structured_outputs_flags_with_underscores() -> None:
    args = serve_args("--structured_outputs_config.compile_timeout_s", "5")
    assert args.structured_outputs_config == {"compile_timeout_s": 5}


def _main_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """stderr of `vllm ARGV`, which must exit with status 2 and print no usage."""
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert "usage:" not in captured.err + captured.out
    return captured.err


def test_quantization_flag_and_short_alias() -> None:
    assert serve_args("--quantization", "gptq").quantization == "gptq"
    assert serve_args("-q", "fp8").quantization == "fp8"
    assert serve_args().quantization is None


def test_unknown_flag_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    err = _main_error(capsys, "serve", MODEL, "--cpu-offload-gb", "4")
    assert err.startswith("vllm serve: error: unsupported option --cpu-offload-gb: this engine "
                          "does not implement it")
    assert "--cpu-offload-gb 4" in err
    assert "vllm serve --help" in err
    # With --model, argparse takes `4` for the positional MODEL; the flag is still refused.
    err = _main_error(capsys, "serve", "--model", MODEL, "--cpu-offload-gb=4", "--foo_bar")
    assert "unsupported options --cpu-offload-gb, --foo-bar" in err


def test_unknown_bench_flag_names_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    err = _main_error(capsys, "bench", "serve", "--model", "m", "--cpu-offload-gb", "4")
    assert err.startswith("vllm bench serve: error: unsupported option --cpu-offload-gb")


def test_bad_values_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    err = _main_error(capsys, "serve", MODEL, "-tp", "two")
    assert "invalid int value: 'two'" in err and "-tp" in err
    err = _main_error(capsys, "serve", MODEL, "--distributed-executor-backend", "dask")
    assert "invalid choice: 'dask'" in err
    err = _main_error(capsys, "serve", MODEL, "--ray-placement", "scatter")
    assert "invalid choice: 'scatter'" in err
    err = _main_error(capsys, "serve", MODEL, "--max-num", "8")  # two flags start with it
    assert "ambiguous option: --max-num" in err


def test_unknown_arguments_message() -> None:
    assert unknown_arguments_message(["--a=1", "x", "-b"]) == (
        "unsupported options --a, -b: this engine does not implement them "
        "(unrecognized arguments: --a=1 x -b)"
    )
    assert unknown_arguments_message(["x", "y"]) == "unexpected argument(s): x y"


def test_flexible_parser_on_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    parser = FlexibleArgumentParser(prog="p")
    parser.add_argument("--some-flag", type=int)
    assert parser.parse_args(["--some_flag=3"]).some_flag == 3
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--other"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("p: error: unsupported option --other")


def test_serve_help_documents_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
                 "--distributed-executor-backend {mp,ray,uni}", "--ray-placement {pack,spread}",
                 "--trust-remote-code"):
        assert flag in text, flag
    assert "runs only its own model code" in text
    assert "default: mp when tensor x pipeline parallel size is above 1" in text


# --- EngineArgs -> VllmConfig ------------------------------------------------------------


def test_world_size_one_resolves_to_uni_or_mp() -> None:
    config = EngineArgs(model=MODEL, trust_remote_code=True).create_engine_config()
    pc = config.parallel_config
    assert (pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.world_size) == (1, 1, 1)
    assert pc.distributed_executor_backend == "uni"
    mp = EngineArgs(model=MODEL, distributed_executor_backend="mp").create_engine_config()
    assert mp.parallel_config.distributed_executor_backend == "mp"
    assert mp.parallel_config.world_size == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 3}, r"--tensor-parallel-size 3: the model's 4 attention heads"),
    ({"pipeline_parallel_size": 3}, r"--pipeline-parallel-size 3: more stages than the "
                                    r"model's 2 layers"),
    ({"tensor_parallel_size": 0}, r"--tensor-parallel-size: must be a positive integer"),
    ({"pipeline_parallel_size": -1}, r"--pipeline-parallel-size: must be a positive integer"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
     r"--distributed-executor-backend uni: .* needs 2 ranks; use mp"),
    ({"distributed_executor_backend": "dask"}, r"--distributed-executor-backend: must be"),
    ({"distributed_executor_backend": "ray", "ray_placement": "x"}, r"--ray-placement: must"),
    ({"health_check_interval": 0}, r"--health-check-interval: must be a positive number"),
    ({"health_check_interval": float("nan")}, r"--health-check-interval: must be a positive"),
])
def test_invalid_layouts_name_the_flag(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=MODEL, **kwargs).create_engine_config()


@pytest.fixture
def many_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Enough GPUs for any layout here, so that a CUDA machine checks the same as a CPU one."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)


@pytest.mark.usefixtures("many_gpus")
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
def test_valid_parallel_layouts_build_a_config(tp: int, pp: int) -> None:
    config = EngineArgs(model=MODEL, tensor_parallel_size=tp,
                        pipeline_parallel_size=pp).create_engine_config()
    assert config.parallel_config.world_size == tp * pp
    assert config.parallel_config.distributed_executor_backend == "mp"


@pytest.mark.usefixtures("many_gpus")
def test_serve_reports_layout_errors_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", MODEL, "-tp", "3", "--port", "0"]) == 2
    assert "--tensor-parallel-size 3" in capsys.readouterr().err
    assert main(["serve", MODEL, "-pp=3", "--port", "0"]) == 2
    assert "more stages than the model's" in capsys.readouterr().err


def test_disable_additional_properties_from_the_flag_and_from_llm_kwargs() -> None:
    def closed(args: EngineArgs) -> bool:
        return args.create_engine_config().structured_outputs_config.disable_additional_properties

    assert closed(serve_args("--structured-outputs-config.disable_additional_properties",
                             "true"))
    # What LLM(structured_outputs_config={...}) builds.
    assert closed(EngineArgs(model=MODEL, structured_outputs_config={
        "disable_additional_properties": True}))
    assert not closed(serve_args())
    with pytest.raises(ValueError, match="disable_additional_properties: must be true or"):
        closed(EngineArgs(model=MODEL, structured_outputs_config={
            "disable_additional_properties": "yes"}))


def test_reasoning_parser_flag_reaches_the_structured_outputs_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = serve_args("--reasoning-parser", "deepseek_r1").create_engine_config()
    assert config.structured_outputs_config.reasoning_parser == "deepseek_r1"
    dotted = serve_args("--structured-outputs-config.reasoning_parser", "qwen3")
    assert dotted.create_engine_config().structured_outputs_config.reasoning_parser == "qwen3"
    clash = serve_args("--reasoning-parser", "qwen3",
                       "--structured-outputs-config.reasoning_parser", "deepseek_r1")
    with pytest.raises(ValueError, match="--reasoning-parser qwen3 and .* disagree"):
        clash.create_engine_config()
    with pytest.raises(ValueError, match="--reasoning-parser: 'mistral' is not one of"):
        serve_args("--structured-outputs-config.reasoning_parser", "mistral").create_engine_config()
    # Checked once a --reasoning-parser-plugin could have registered the name.
    with pytest.raises(ValueError, match="--reasoning-parser: 'mistral' is not one of"):
        serve_args("--reasoning-parser", "mistral").create_engine_config()
    assert main(["serve", MODEL, "--reasoning-parser", "mistral", "--port", "0"]) == 2
    assert "--reasoning-parser: 'mistral' is not one of" in capsys.readouterr().err


PLUGIN = """
from vllm.reasoning import ReasoningParserManager
from vllm.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser


@ReasoningParserManager.register_module("{name}")
class PluginParser(Qwen3ReasoningParser):
    always_thinks = True
"""


def test_reasoning_parser_plugin_registers_before_the_name_is_looked_up(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm.reasoning import ReasoningParserManager

    plugin = tmp_path / "my_parsers.py"
    plugin.write_text(PLUGIN.format(name="from_plugin_flag"))
    with pytest.raises(ValueError, match="'from_plugin_flag' is not one of"):
        serve_args("--reasoning-parser", "from_plugin_flag").create_engine_config()
    config = serve_args("--reasoning-parser", "from_plugin_flag", "--reasoning-parser-plugin",
                        str(plugin)).create_engine_config().structured_outputs_config
    assert config.reasoning_parser == "from_plugin_flag"
    assert config.reasoning_parser_plugin == str(plugin.resolve())
    assert ReasoningParserManager.get_reasoning_parser("from_plugin_flag").always_thinks
    # Refused at startup, naming the flag: a missing file, and one that raises.
    assert main(["serve", MODEL, "--reasoning-parser-plugin", str(tmp_path / "no.py"),
                 "--port", "0"]) == 2
    assert "--reasoning-parser-plugin: " in capsys.readouterr().err
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="--reasoning-parser-plugin: importing .* RuntimeError: boom"):
        serve_args("--reasoning-parser-plugin", str(broken)).create_engine_config()


def test_enable_in_reasoning_and_override_generation_config_flags() -> None:
    config = serve_args("--structured-outputs-config.enable_in_reasoning", "true",
                        "--generation-config", "vllm",
                        "--override-generation-config", '{"temperature": 0.25}',
                        ).create_engine_config()
    assert config.structured_outputs_config.enable_in_reasoning is True
    assert config.model_config.sampling_defaults == {"temperature": 0.25}
    assert serve_args().create_engine_config().structured_outputs_config.enable_in_reasoning \
        is False
    with pytest.raises(ValueError, match="enable_in_reasoning: must be true or false"):
        serve_args("--structured-outputs-config.enable_in_reasoning", "1").create_engine_config()
    with pytest.raises(ValueError, match="--override-generation-config: 'do_sample' not"):
        serve_args("--override-generation-config", '{"do_sample": false}').create_engine_config()


def test_speculative_config_flag_builds_the_config() -> None:
    args = serve_args("--speculative-config",
                      '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    config = args.create_engine_config()
    spec = config.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min,
            spec.prompt_lookup_max) == ("ngram", 5, 1, 3)
    assert config.num_speculative_tokens == 5
    assert EngineArgs(model=MODEL).create_engine_config().num_speculative_tokens == 0


@pytest.mark.parametrize("legacy, want", [
    ({"model": "[ngram]", "num_speculative_tokens": 5, "ngram_prompt_lookup_max": 3},
     ("ngram", None, 5, 3)),
    ({"model": "ngram", "ngram_prompt_lookup_min": 2, "ngram_prompt_lookup_max": 2},
     ("ngram", None, 3, 2)),
    ({"model": "demo-tiny", "num_speculative_tokens": 2}, ("draft_model", "demo-tiny", 2, 4)),
])
def test_upstreams_older_speculative_spellings(legacy: dict, want: tuple) -> None:
    spec = EngineArgs(model=MODEL, speculative_config=legacy).create_engine_config()\
        .speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens, spec.prompt_lookup_max) == want


def test_fast_forward_flag_drafts_forced_tokens_only() -> None:
    config = serve_args("--structured-outputs-config.fast_forward", "true").create_engine_config()
    spec = config.speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("grammar", 8)
    # An explicit speculative config wins: its drafts already start with the forced tokens.
    both = serve_args("--structured-outputs-config.fast_forward", "true", "--speculative-config",
                      '{"method": "ngram"}').create_engine_config()
    assert both.speculative_config.method == "ngram"
    assert EngineArgs(model=MODEL).create_engine_config().speculative_config is None


@pytest.mark.parametrize("value, mode, drafts", [
    ("canonical", "canonical", True), ("exact", "exact", True), ("off", "off", False),
    ("false", "off", False),
])
def test_fast_forward_modes_from_the_command_line(value: str, mode: str, drafts: bool) -> None:
    config = serve_args("--structured-outputs-config.fast_forward", value).create_engine_config()
    assert config.structured_outputs_config.fast_forward == mode
    assert (config.speculative_config is not None) == drafts
    with pytest.raises(ValueError, match="fast_forward: must be one of off, exact, canonical"):
        serve_args("--structured-outputs-config.fast_forward", "fastest").create_engine_config()


@pytest.mark.usefixtures("many_gpus")
@pytest.mark.parametrize("flags", [("--structured-outputs-config.fast_forward", "canonical"),
                                   ("--speculative-config", '{"method": "ngram"}')])
def test_drafts_with_pipeline_stages(flags: tuple[str, str]) -> None:
    config = serve_args(*flags, "--pipeline-parallel-size", "2").create_engine_config()
    assert config.parallel_config.pipeline_parallel_size == 2
    assert config.speculative_config is not None


@pytest.mark.parametrize("spec, message", [
    ({"method": "eagle"}, r"--speculative-config.method: 'eagle' \(EAGLE-1/2 heads, which "
                          r"read the target's last hidden state\) is not supported; use an "
                          r"EAGLE-3 head with method 'eagle3'"),
    ({"method": "medusa"}, r"--speculative-config.method: 'medusa' is not supported"),
    ({"method": "eagle3"}, r"--speculative-config.model: required with method"),
    ({"method": "draft_model"}, r"--speculative-config.model: required with method"),
    ({"method": "ngram", "model": "demo-tiny"}, r"--speculative-config.model: required"),
    ({"num_speculative_tokens": 0}, r"num_speculative_tokens: must be a positive integer"),
    ({"num_speculative_tokens": 99}, r"num_speculative_tokens: at most 16"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, r"prompt_lookup_min \(4\) must not"),
    ({"draft_tokens": 3}, r"unknown option\(s\) \['draft_tokens'\]"),
    ([3], r"must be a JSON object"),
])
def test_bad_speculative_configs_name_the_option(spec: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=MODEL, speculative_config=spec).create_engine_config()


def _async_mode(engine_args: EngineArgs) -> bool:
    return engine_args.create_engine_config().scheduler_config.async_scheduling


def test_async_scheduling_is_on_by_default_and_can_be_turned_off() -> None:
    # As in upstream vLLM: on unless switched off, on the CLI and in LLM(...) kwargs alike.
    assert _async_mode(serve_args()) is True
    assert _async_mode(serve_args("--async-scheduling")) is True
    assert _async_mode(serve_args("--no-async-scheduling")) is False
    assert _async_mode(serve_args("--no_async_scheduling")) is False
    assert _async_mode(EngineArgs(model=MODEL)) is True
    assert _async_mode(EngineArgs(model=MODEL, async_scheduling=None)) is True
    assert _async_mode(EngineArgs(model=MODEL, async_scheduling=False)) is False
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(model=MODEL, async_scheduling="yes").create_engine_config()  # type: ignore[arg-type]


def test_scheduling_mode_is_described_for_the_startup_log() -> None:
    on = EngineArgs(model=MODEL).create_engine_config().scheduling_mode()
    off = EngineArgs(model=MODEL, async_scheduling=False).create_engine_config().scheduling_mode()
    assert on.startswith("async scheduling: on") and "--no-async-scheduling" in on
    assert off.startswith("async scheduling: off")


@pytest.mark.parametrize("flags", [["--kv-cache-dtype", "fp8"], ["--kv_cache_dtype=fp8_e4m3"]])
def test_kv_cache_dtype_flag_reaches_the_cache_config(flags: list[str]) -> None:
    args = serve_args(*flags)
    assert args.kv_cache_dtype == flags[-1].rpartition("=")[2]
    assert args.create_engine_config().cache_config.cache_dtype == args.kv_cache_dtype
    assert serve_args().create_engine_config().cache_config.cache_dtype == "auto"


def test_a_bad_kv_cache_dtype_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    err = _main_error(capsys, "serve", MODEL, "--kv-cache-dtype", "fp16")
    assert "--kv-cache-dtype" in err and "invalid choice: 'fp16'" in err
    assert "auto" in err and "fp8_e4m3" in err
    with pytest.raises(ValueError, match="--kv-cache-dtype: 'int8' is not supported"):
        EngineArgs(model=MODEL, kv_cache_dtype="int8").create_engine_config()


def test_demo_models_serve_compact_json_unless_told(tmp_path) -> None:
    def compact(args: EngineArgs) -> bool | None:
        return args.create_engine_config().structured_outputs_config.disable_any_whitespace

    assert compact(EngineArgs(model=MODEL)) is True
    # The embedded default is a real model: upstream's default, whitespace allowed.
    assert compact(serve_args()) is False
    assert compact(serve_args("--structured-outputs-config.disable_any_whitespace", "false")) \
        is False
    assert compact(EngineArgs(model=MODEL, structured_outputs_config={})) is True
    # Any other model keeps upstream's default: whitespace allowed.
    from vllm.model_executor.model_loader.demo_model import build_demo_model

    local = build_demo_model(MODEL)  # a directory, even the demo's own, is not a demo name
    assert compact(EngineArgs(model=str(local))) is False
    assert compact(EngineArgs(model=str(local), structured_outputs_config={
        "disable_any_whitespace": True})) is True


def test_scheduling_policy_flag_reaches_the_scheduler_config(
        capsys: pytest.CaptureFixture[str]) -> None:
    def policy(args: EngineArgs) -> str:
        return args.create_engine_config().scheduler_config.policy

    assert policy(serve_args()) == "fcfs"
    assert policy(serve_args("--scheduling-policy", "priority")) == "priority"
    assert policy(EngineArgs(model=MODEL, scheduling_policy="priority")) == "priority"
    err = _main_error(capsys, "serve", MODEL, "--scheduling-policy", "lifo")
    assert "--scheduling-policy" in err and "invalid choice: 'lifo'" in err
    with pytest.raises(ValueError, match="--scheduling-policy"):
        EngineArgs(model=MODEL, scheduling_policy="lifo").create_engine_config()
