"""Helpers that upstream vLLM users import: vllm.utils.FlexibleArgumentParser and
vllm.platforms.current_platform (get_tokenizer: tests/transformers_utils; the xgrammar
schema check: tests/v1/structured_output/backends/test_xgrammar.py)."""

from __future__ import annotations

import pytest
import torch

from vllm.platforms import current_platform
from vllm.utils import FlexibleArgumentParser
from vllm.utils.argparse_utils import FlexibleArgumentParser as FromArgparseUtils


def test_flexible_parser_takes_dashes_and_underscores() -> None:
    assert FromArgparseUtils is FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--tensor_parallel_size", type=int)  # defined with underscores
    parser.add_argument("--enforce-eager", action="store_true")
    for argv in (["--max-model-len", "8", "--tensor-parallel-size", "2", "--enforce-eager"],
                 ["--max_model_len=8", "--tensor_parallel_size", "2", "--enforce_eager"]):
        args = parser.parse_args(argv)
        assert (args.max_model_len, args.tensor_parallel_size, args.enforce_eager) == (8, 2, True)


def test_flexible_parser_refuses_unknown_flags(capsys: pytest.CaptureFixture[str]) -> None:
    parser = FlexibleArgumentParser(prog="p")
    parser.add_argument("--a-b", type=int)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--c_d", "1"])
    assert e.value.code == 2 and "--c-d" in capsys.readouterr().err


def test_current_platform_matches_torch() -> None:
    cuda = torch.cuda.is_available()
    assert current_platform.device_type == ("cuda" if cuda else "cpu")
    assert current_platform.is_cuda() is cuda and current_platform.is_cpu() is not cuda
    assert not current_platform.is_rocm() and not current_platform.is_tpu()
    assert current_platform.device_count() >= 1
    if not cuda:
        assert current_platform.get_device_name() == "cpu"
