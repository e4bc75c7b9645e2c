"""The interface of a `vllm` subcommand."""

from __future__ import annotations

import argparse


class CLISubcommand:
    """One `vllm <name>` command. Modules of this package register theirs in `cmd_init()`."""

    name: str = ""

    def subparser_init(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        """Adds this command's parser (and its flags) to `subparsers`; returns it."""
        raise NotImplementedError

    def cmd(self, args: argparse.Namespace) -> int:
        """Runs the command; returns the process exit status."""
        raise NotImplementedError
