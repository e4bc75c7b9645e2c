"""`FlexibleArgumentParser` where upstream vLLM keeps it (`vllm.utils.argparse_utils`): an
argparse parser that takes long flags spelled with dashes or underscores."""

from __future__ import annotations

from vllm.entrypoints.cli.arg_parser import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
