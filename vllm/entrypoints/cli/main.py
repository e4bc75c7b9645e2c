"""The `vllm` console script: `vllm serve`, and whatever other subcommands are installed.

`python -m vllm.entrypoints.cli.main ARGS` is the same command. A subcommand is any module of
this package with a `cmd_init() -> list[CLISubcommand]` function; adding
`vllm/entrypoints/cli/bench.py` with one is enough to add `vllm bench`. Flags are parsed as
upstream vLLM spells them (vllm/utils/argparse_utils.py).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from vllm import __version__
from vllm.entrypoints.cli.arg_parser import prepare_argv
from vllm.entrypoints.cli.types import CLISubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

# Modules here that are not subcommands.
_NOT_COMMANDS = {"main", "types", "arg_parser"}


def discover_subcommands() -> list[CLISubcommand]:
    """Every subcommand this package provides, sorted by name.

    A module that fails to import is reported on stderr and skipped, so one broken
    subcommand cannot take the others down.
    """
    import vllm.entrypoints.cli as package

    commands: list[CLISubcommand] = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name in _NOT_COMMANDS or info.name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"{package.__name__}.{info.name}")
        except Exception as e:  # a broken optional command must not break `vllm serve`
            print(f"warning: vllm {info.name}: cannot load ({type(e).__name__}: {e})",
                  file=sys.stderr)
            continue
        init = getattr(module, "cmd_init", None)
        if init is not None:
            commands.extend(init())
    return sorted(commands, key=lambda c: c.name)


def make_parser(commands: list[CLISubcommand]) -> argparse.ArgumentParser:
    """The top-level parser with one subparser per command."""
    parser = FlexibleArgumentParser(
        prog="vllm", description="vLLM-style LLM serving engine command line."
    )
    parser.add_argument("-v", "--version", action="version", version=__version__)
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    for command in commands:
        command.subparser_init(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parses the command line and runs the subcommand; returns the exit status.

    A malformed command line exits (SystemExit, status 2) with a one-line error.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = discover_subcommands()
    parser = make_parser(commands)
    try:
        argv = prepare_argv(argv)
    except ValueError as e:
        parser.error(str(e))
    args = parser.parse_args(argv)
    if not args.subcommand:
        parser.print_help()
        return 1
    command = next(c for c in commands if c.name == args.subcommand)
    return command.cmd(args)


if __name__ == "__main__":
    sys.exit(main())
