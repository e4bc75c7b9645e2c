"""vllm/options.py: the bottom layer's option names. Reading them, or checking a config or a
request's parameters against them, loads nothing of the engine above."""

from __future__ import annotations

import subprocess
import sys

from vllm import options


def test_config_and_request_parameters_load_nothing_of_v1() -> None:
    # A fresh interpreter: this one has loaded the engine already.
    code = (
        "import sys\n"
        "from vllm.config import ParallelConfig, StructuredOutputsConfig\n"
        "ParallelConfig(tensor_parallel_size=2, distributed_executor_backend='ray')\n"
        "from vllm.sampling_params import SamplingParams, StructuredOutputsParams\n"
        "StructuredOutputsConfig(backend='guidance', fast_forward='exact')\n"
        "StructuredOutputsParams(json={}, backend='llguidance', fast_forward=True)\n"
        "print(sorted(m for m in sys.modules if m.startswith('vllm.v1')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_executor_help_lists_every_name_once() -> None:
    text = options.describe_executors()
    for name in options.executor_names():
        assert text.count(f"{name} (") == 1
    assert text.count(" or ") == 1


def test_every_executor_class_agrees_with_its_entry() -> None:
    """The configuration checks a layout against the table without importing executors; the
    classes (which executors passed as a class are checked by) must say the same."""
    from vllm.v1.executor.registry import resolve

    for name, entry in options.EXECUTORS.items():
        try:
            cls = resolve(name)
        except ImportError:  # ray is an optional extra
            continue
        assert (cls.max_world_size, cls.remote_devices) == (
            entry.max_world_size, entry.remote_devices), name
