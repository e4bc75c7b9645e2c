"""Tests for vllm/config/parallel.py's ParallelConfig: the derived world size and executor, the layout
checks against the model and the machine, and the refusal of world sizes above 1 in
VllmConfig while the model code cannot run sharded."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from vllm import thread_policy
from vllm.config import ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig


def fake_model(heads: int, kv_heads: int | None, layers: int) -> SimpleNamespace:
    """A stand-in for ModelConfig with just the sizes the layout checks read."""
    return SimpleNamespace(hf_config=SimpleNamespace(
        num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=layers
    ))


@pytest.mark.parametrize("tp, pp, backend", [(1, 1, "uni"), (2, 1, "mp"), (1, 2, "mp"),
                                             (2, 3, "mp")])
def test_world_size_and_default_backend(tp: int, pp: int, backend: str) -> None:
    pc = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert pc.world_size == tp * pp
    assert pc.distributed_executor_backend == backend


def test_explicit_backends() -> None:
    assert ParallelConfig(distributed_executor_backend="mp").distributed_executor_backend == "mp"
    assert ParallelConfig(2, 1, "mp").world_size == 2
    with pytest.raises(ValueError, match=r"--distributed-executor-backend uni: runs a single "
                                         r"worker .* needs 4 ranks"):
        ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                       distributed_executor_backend="uni")
    assert ParallelConfig(2, 2, "ray").world_size == 4
    with pytest.raises(ValueError, match=r"--distributed-executor-backend: must be 'uni', "
                                         r"'mp' or 'ray', got 'dask'"):
        ParallelConfig(distributed_executor_backend="dask")
    with pytest.raises(ValueError, match=r"--ray-placement: must be 'pack' or 'spread', "
                                         r"got 'scatter'"):
        ParallelConfig(distributed_executor_backend="ray", ray_placement="scatter")


def test_an_executor_class_may_be_passed_as_the_backend() -> None:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.executor.registry import resolve
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    pc = ParallelConfig(tensor_parallel_size=2, distributed_executor_backend=MultiprocExecutor)
    assert pc.executor_facts() == (None, False)
    assert resolve(pc.distributed_executor_backend) is MultiprocExecutor
    with pytest.raises(ValueError, match=r"--distributed-executor-backend UniProcExecutor: "
                                         r"runs a single worker .* needs 2 ranks"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend=UniProcExecutor)
    with pytest.raises(ValueError, match=r"--distributed-executor-backend: a class must "
                                         r"subclass Executor, got int"):
        ParallelConfig(distributed_executor_backend=int)


def test_every_registered_backend_is_a_flag_choice_and_an_executor() -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.options import executor_names
    from vllm.v1.executor.registry import resolve

    field = {f.name: f for f in dataclasses.fields(EngineArgs)}["distributed_executor_backend"]
    assert sorted(field.metadata["choices"]) == sorted(executor_names())
    for name in executor_names():
        assert name in field.metadata["help"]
        cls = resolve(ParallelConfig(distributed_executor_backend=name).distributed_executor_backend)
        assert ParallelConfig(distributed_executor_backend=name).executor_facts() == (
            cls.max_world_size, cls.remote_devices)


@pytest.mark.parametrize("field, value", [
    ("tensor_parallel_size", 0), ("pipeline_parallel_size", -2), ("tensor_parallel_size", True),
    ("pipeline_parallel_size", 1.5),
])
def test_sizes_must_be_positive_integers(field: str, value: object) -> None:
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=f"{flag}: must be a positive integer"):
        ParallelConfig(**{field: value})


def test_world_size_is_derived_not_passed() -> None:
    with pytest.raises(TypeError):
        ParallelConfig(world_size=2)  # type: ignore[call-arg]
    # replace() recomputes it from the sizes.
    pc = dataclasses.replace(ParallelConfig(distributed_executor_backend="mp"),
                             tensor_parallel_size=2, pipeline_parallel_size=2)
    assert pc.world_size == 4


@pytest.mark.parametrize("heads, kv_heads, layers, tp, pp", [
    (4, 2, 2, 1, 1),
    (4, 2, 2, 2, 2),   # KV heads split evenly
    (4, 2, 2, 4, 1),   # each KV head replicated on 2 ranks
    (8, 1, 3, 8, 3),   # multi-query: the one KV head on every rank; one layer per stage
    (6, None, 4, 3, 4),  # no num_key_value_heads: as many as attention heads
])
def test_layouts_the_model_splits_into(heads: int, kv_heads: int | None, layers: int,
                                       tp: int, pp: int) -> None:
    ParallelConfig(tp, pp).verify_with_model_config(fake_model(heads, kv_heads, layers))


@pytest.mark.parametrize("heads, kv_heads, layers, tp, pp, message", [
    (4, 2, 2, 3, 1, r"--tensor-parallel-size 3: the model's 4 attention heads do not divide "
                    r"evenly among 3 ranks"),
    (12, 4, 2, 3, 1, r"--tensor-parallel-size 3: the model's 4 KV heads can neither be split "
                     r"evenly among 3 ranks nor replicated evenly"),
    (12, 8, 2, 12, 1, r"the model's 8 KV heads .* \(12 is not a multiple of 8\)"),
    (4, 2, 2, 1, 3, r"--pipeline-parallel-size 3: more stages than the model's 2 layers"),
])
def test_layouts_the_model_does_not_split_into(heads: int, kv_heads: int, layers: int, tp: int,
                                               pp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelConfig(tp, pp).verify_with_model_config(fake_model(heads, kv_heads, layers))


def test_cuda_needs_a_gpu_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cuda = torch.device("cuda")
    ParallelConfig(2, 1).verify_devices(cuda)
    ParallelConfig(1, 1).verify_devices(cuda)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 x --pipeline-parallel-size "
                                         r"2 = 4 ranks need 4 GPUs \(one per rank\), but 2 are "
                                         r"visible"):
        ParallelConfig(2, 2).verify_devices(cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="need 2 GPUs .* but 1 is visible"):
        ParallelConfig(1, 2).verify_devices(cuda)


def test_cpu_allows_more_ranks_than_cores_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(thread_policy.NUM_THREADS_ENV, raising=False)
    monkeypatch.setattr(thread_policy, "available_cpus", lambda: 2)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="vllm.config"):
        ParallelConfig(2, 1).verify_devices(cpu)
        assert not caplog.records
        ParallelConfig(2, 2).verify_devices(cpu)
    [record] = caplog.records
    message = record.getMessage()
    assert "4 ranks on 2 CPU core(s): more ranks than cores" in message
    assert "each rank gets 1 thread(s)" in message


# --- VllmConfig ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_tiny() -> ModelConfig:
    return ModelConfig(model="demo-tiny")


def test_vllm_config_checks_the_layout_against_the_model(demo_tiny: ModelConfig) -> None:
    with pytest.raises(ValueError, match="attention heads"):
        VllmConfig(model_config=demo_tiny, parallel_config=ParallelConfig(3, 1))
    with pytest.raises(ValueError, match="more stages than the model's 2 layers"):
        VllmConfig(model_config=demo_tiny, parallel_config=ParallelConfig(1, 3))
    odd_mlp = dataclasses.replace(demo_tiny)
    odd_mlp.hf_config = SimpleNamespace(**{**vars(demo_tiny.hf_config), "intermediate_size": 130,
                                           "num_attention_heads": 4, "num_key_value_heads": 4})
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4: the model's MLP width"):
        VllmConfig(model_config=odd_mlp, parallel_config=ParallelConfig(4, 1))


def test_vllm_config_accepts_parallel_layouts(
    demo_tiny: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for tp, pp, async_scheduling, depth in ((2, 1, False, 1), (1, 2, False, 2),
                                             (2, 2, True, 2), (1, 1, True, 2)):
        config = VllmConfig(
            model_config=demo_tiny,
            parallel_config=ParallelConfig(tp, pp),
            scheduler_config=SchedulerConfig(async_scheduling=async_scheduling),
        )
        assert config.parallel_config.distributed_executor_backend == (
            "mp" if tp * pp > 1 else "uni"
        )
        assert config.max_concurrent_batches == depth

def test_long_max_model_len_needs_upstreams_switch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ValueError, match=r"--max-model-len: 8192 exceeds .* "
                                         r"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"):
        ModelConfig(model="demo-tiny", max_model_len=8192)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with caplog.at_level(logging.WARNING):
        config = ModelConfig(model="demo-tiny", max_model_len=8192)
    assert config.max_model_len == 8192
    # The rotary tables are sized from the config, so they now cover every position.
    assert config.hf_config.max_position_embeddings == 8192
    assert "never trained" in caplog.text
