"""`FlexibleArgumentParser`, where upstream vLLM keeps it (`vllm.utils.argparse_utils`): the
parser of the `vllm` command line and of `python -m vllm.entrypoints.openai.api_server`.

It accepts flags as upstream vLLM users type them:

- underscores in a long flag's name are dashes (`--distributed_executor_backend=mp` is
  `--distributed-executor-backend=mp`); values are left alone;
- `-tp=2` and `-tp 2` both work (argparse splits `=` for single-dash flags too);
- an unambiguous prefix of a long flag is that flag (`--gpu-memory-util=0.9` is
  `--gpu-memory-utilization=0.9`; argparse's `allow_abbrev`, on by default, and inherited by
  every subcommand's parser).

A parse error is one line on stderr naming the flag, then exit status 2, never a usage dump;
a flag the engine does not implement (e.g. `--cpu-offload-gb 4`) is reported as such.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn


def normalize_flag_spellings(argv: Sequence[str]) -> list[str]:
    """`argv` with the underscores of every long flag's name turned into dashes.

    Only the name is changed (`--max_model_len=8192` becomes `--max-model-len=8192`); values,
    short flags and everything after a bare `--` are kept as they are.
    """
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            out.extend(argv[i:])
            break
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def unknown_arguments_message(extras: Sequence[str]) -> str:
    """The error for arguments no parser took: the flags among them by name."""
    flags = [arg.partition("=")[0] for arg in extras if arg.startswith("-") and len(arg) > 1]
    given = " ".join(extras)
    if not flags:
        return f"unexpected argument(s): {given}"
    plural = len(flags) > 1
    return (
        f"unsupported option{'s' if plural else ''} {', '.join(flags)}: this engine does not "
        f"implement {'them' if plural else 'it'} (unrecognized arguments: {given})"
    )


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser for upstream vLLM's flag spellings, with one-line errors.

    Subcommand parsers made by `add_subparsers().add_parser` are of this class too.
    """

    def add_argument(self, *names: Any, **kwargs: Any) -> argparse.Action:  # type: ignore[override]
        """As argparse; a long flag defined with underscores (`--a_b`) is registered as
        `--a-b`, the spelling every command line is normalized to, so both spellings work."""
        names = tuple(
            n.replace("_", "-") if isinstance(n, str) and n.startswith("--") else n
            for n in names
        )
        return super().add_argument(*names, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        """As argparse, after `normalize_flag_spellings` (`args` default: sys.argv[1:])."""
        argv = sys.argv[1:] if args is None else args
        return super().parse_known_args(normalize_flag_spellings(argv), namespace)

    def parse_args(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        namespace: argparse.Namespace | None = None,
    ) -> argparse.Namespace:
        """As argparse; arguments nobody took are an error of the (sub)command they were
        given to, naming them (exit status 2)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._selected_parser(parsed).error(unknown_arguments_message(extras))
        return parsed

    def _selected_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The innermost subcommand parser `parsed` went through (`vllm bench serve`'s)."""
        parser: argparse.ArgumentParser = self
        while True:
            subparsers = next(
                (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None
            )
            name = getattr(parsed, subparsers.dest, None) if subparsers is not None else None
            if subparsers is None or name not in subparsers.choices:
                return parser
            parser = subparsers.choices[name]

    def error(self, message: str) -> NoReturn:
        """Prints `PROG: error: MESSAGE` and a pointer to --help, then exits with status 2."""
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the options)\n")
