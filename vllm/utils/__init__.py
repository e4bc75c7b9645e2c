"""Helpers that upstream vLLM users import from `vllm.utils`."""

from __future__ import annotations

from vllm.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
