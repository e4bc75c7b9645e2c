"""Command-line arguments as the `vllm` commands prepare them before parsing (the parser
itself, `FlexibleArgumentParser`, is in vllm/utils/argparse_utils.py)."""

from __future__ import annotations

from collections.abc import Sequence

from vllm.utils.argparse_utils import FlexibleArgumentParser, normalize_flag_spellings

__all__ = ["FlexibleArgumentParser", "prepare_argv"]


def prepare_argv(argv: Sequence[str]) -> list[str]:
    """`argv` ready for the parser: upstream spellings normalized, then the dotted
    `--structured-outputs-config.KEY VALUE` flags merged into one JSON flag.

    Raises ValueError for a dotted flag without a value.
    """
    from vllm.engine.arg_utils import merge_dotted_args

    return merge_dotted_args(normalize_flag_spellings(argv))
