"""The structured-output serving benchmark: `python -m vllm.benchmarks.structured_output`, or
benchmarks/benchmark_serving_structured_output.py in a checkout.

Like the general serving benchmark, but a chosen share of the requests carries a JSON schema,
regex, choice list or EBNF grammar, and every structured output is checked against it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from vllm.benchmarks.assets import DEFAULT_SCHEMA_NAME, SCHEMA_NAMES
from vllm.benchmarks.datasets import (
    STRUCTURED_DATASETS,
    SampleRequest,
    Tokenizer,
    build_structured_requests,
    load_schema,
)
from vllm.benchmarks.metrics import format_report
from vllm.benchmarks.serve import (
    RunResult,
    add_common_args,
    check_common_args,
    exit_status,
    format_spec_decode,
    load_tokenizer,
    parse_extra_body,
    resolve_model,
    result_record,
    run_counting_drafts,
    save_result,
    summarize_run,
)
from vllm.benchmarks.validation import CorrectnessReport, evaluate


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """All flags of the structured-output benchmark."""
    add_common_args(parser)
    parser.add_argument("--dataset", default="json", choices=STRUCTURED_DATASETS,
                        help="json: one schema for all; json-unique: a distinct schema per "
                        "request; grammar: SQL EBNF; regex: an email; choice: sentiment.")
    parser.add_argument("--json-schema-path", default=None,
                        help="Schema file for json/json-unique, or the name of a shipped "
                        f"schema: {', '.join(SCHEMA_NAMES)} (default: {DEFAULT_SCHEMA_NAME}).")
    parser.add_argument("--structured-output-ratio", type=float, default=1.0,
                        help="Share of requests that carry the constraint (0..1).")
    parser.add_argument("--no-structured-output", action="store_true",
                        help="Send every request unconstrained (ratio 0).")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens per request.")
    parser.add_argument("--extra-body", default=None,
                        help="JSON object merged into every request body.")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Validate the flags before anything is loaded. Raises ValueError naming the flag."""
    check_common_args(args)
    if not 0.0 <= args.structured_output_ratio <= 1.0:
        raise ValueError(
            f"--structured-output-ratio: must be in [0, 1], got {args.structured_output_ratio}"
        )
    if args.output_len < 1:
        raise ValueError(f"--output-len: must be positive, got {args.output_len}")
    if args.dataset.startswith("json"):
        load_schema(args.json_schema_path)


def build_requests(args: argparse.Namespace, tokenizer: Tokenizer) -> list[SampleRequest]:
    """The run's requests from its flags. Raises ValueError for bad flags."""
    ratio = 0.0 if args.no_structured_output else args.structured_output_ratio
    schema = None
    if args.dataset.startswith("json"):
        schema = load_schema(args.json_schema_path)
    return build_structured_requests(
        args.dataset,
        tokenizer,
        args.num_prompts,
        args.output_len,
        structured_ratio=ratio,
        schema=schema,
        seed=args.seed,
    )


def run(
    args: argparse.Namespace, tokenizer: Tokenizer | None = None, quiet: bool = False
) -> dict[str, Any]:
    """Run the benchmark against the server the flags name; prints the report unless `quiet`
    and returns the result record (metrics plus correctness).

    Raises ValueError for bad flags and RuntimeError if the server cannot be used.
    """
    check_args(args)
    extra_body = parse_extra_body(args.extra_body)
    model = resolve_model(args)
    if tokenizer is None:
        tokenizer = load_tokenizer(args.tokenizer or model)
    requests = build_requests(args, tokenizer)
    result, spec = run_counting_drafts(args, requests, model, extra_body)
    metrics = summarize_run(args, result, tokenizer)
    report, verdicts = evaluate(result.outputs, [r.structured for r in requests])
    record = result_record(args, model, metrics, result)
    record.update(
        dataset=args.dataset,
        structured_output_ratio=0.0 if args.no_structured_output else args.structured_output_ratio,
        output_len=args.output_len,
        correctness=report.to_dict(),
        valid=verdicts,
        structured=[r.structured is not None for r in requests],
        spec_decode=spec,
    )
    if not quiet:
        print(format_report(metrics, "Structured Output Benchmark"))
        if spec is not None:
            print(format_spec_decode(spec))
        print(format_correctness(report, result))
    if args.save_results:
        path = save_result(args, record, model)
        if not quiet:
            print(f"Results written to {path}")
    return record


def format_correctness(report: CorrectnessReport, result: RunResult) -> str:
    """Lines reporting correctness (structured requests only)."""
    if report.rate is None:
        return "Correctness: no structured requests"
    lines = [
        f"{'Structured requests:':<42}{report.num_structured:>18}",
        f"{'Valid outputs:':<42}{report.num_valid:>18}",
        f"{'Correct rate (%):':<42}{100.0 * report.rate:>18.2f}",
    ]
    if report.stopped_rate is not None:
        lines.append(
            f"{'Correct rate, stopped outputs (%):':<42}{100.0 * report.stopped_rate:>18.2f}"
        )
    truncated = report.num_structured - report.num_stopped
    lines.append(f"{'Structured outputs not stopped:':<42}{truncated:>18}")
    failed = sum(not o.success for o in result.outputs)
    if failed:
        first = next(o.error for o in result.outputs if not o.success)
        lines.append(f"First error: {first}")
    lines.append("=" * 60)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 for bad flags, 1 if the server
    cannot be used)."""
    parser = argparse.ArgumentParser(
        description="Benchmark structured-output serving against a running server."
    )
    add_cli_args(parser)
    args = parser.parse_args(argv)
    return exit_status(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
