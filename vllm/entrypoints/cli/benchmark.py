"""`vllm bench serve`: benchmark a running OpenAI-compatible server."""

from __future__ import annotations

import argparse

from vllm.entrypoints.cli.types import CLISubcommand


class BenchmarkSubcommand(CLISubcommand):
    """`vllm bench <kind>`; the only kind is `serve` (online serving throughput and latency)."""

    name = "bench"

    def subparser_init(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        from vllm.benchmarks.serve import add_cli_args

        parser = subparsers.add_parser("bench", help="Benchmark a running server.")
        kinds = parser.add_subparsers(dest="bench_type", metavar="KIND")
        serve = kinds.add_parser(
            "serve",
            help="Online serving throughput and latency against a running server.",
            description="Send random or custom prompts to an OpenAI-compatible server at a "
            "chosen rate and report throughput, TTFT, TPOT, ITL and end-to-end latency.",
        )
        add_cli_args(serve)
        self._parser = parser
        return parser

    def cmd(self, args: argparse.Namespace) -> int:
        """Runs the benchmark; prints errors from bad flags or an unusable server, returns 2/1."""
        if getattr(args, "bench_type", None) != "serve":
            self._parser.print_help()
            return 1
        from vllm.benchmarks.serve import exit_status, main

        return exit_status(lambda: main(args))


def cmd_init() -> list[CLISubcommand]:
    """The subcommands this module adds to `vllm`."""
    return [BenchmarkSubcommand()]
