"""`vllm serve [MODEL]`: the OpenAI-compatible server over an engine-core process."""

from __future__ import annotations

import argparse

from vllm.entrypoints.cli.types import CLISubcommand
from vllm.entrypoints.openai.cli_args import SERVE_DESCRIPTION, SERVE_EPILOG, add_serve_args


class ServeSubcommand(CLISubcommand):
    """Starts the engine process and the HTTP server; Ctrl-C or SIGTERM stops both."""

    name = "serve"

    def subparser_init(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(
            "serve",
            help="Start the OpenAI-compatible API server.",
            description=SERVE_DESCRIPTION,
            usage="vllm serve [MODEL] [options]",
            epilog=SERVE_EPILOG,
        )
        return add_serve_args(parser)

    def cmd(self, args: argparse.Namespace) -> int:
        # Deferred: `vllm --help` must not import the server.
        from vllm.entrypoints.openai.api_server import run_serve

        return run_serve(args)


def cmd_init() -> list[CLISubcommand]:
    """The subcommands this module adds to `vllm`."""
    return [ServeSubcommand()]
