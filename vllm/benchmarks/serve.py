"""The online serving benchmark behind `vllm bench serve` (and the structured-output script).

Sends requests to a running OpenAI-compatible server at a chosen arrival rate (Poisson, or
gamma with --burstiness) under an optional concurrency cap, and reports throughput and
TTFT/TPOT/ITL/E2EL statistics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from vllm.benchmarks.datasets import (
    SampleRequest,
    Tokenizer,
    load_custom_requests,
    sample_random_requests,
)
from vllm.benchmarks.endpoint_request_func import (
    REQUEST_TIMEOUT,
    RequestFunc,
    RequestFuncInput,
    RequestFuncOutput,
    get_request_func,
)
from vllm.benchmarks.metrics import (
    BenchmarkMetrics,
    calculate_metrics,
    format_report,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
)

BACKENDS = ("vllm", "openai", "openai-compatible", "openai-chat")


@dataclass
class RunResult:
    """Outputs in request order, and the wall time from first send to last completion."""

    outputs: list[RequestFuncOutput]
    duration_s: float


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send times (s from start): all 0 for an infinite rate, else cumulative gamma gaps
    with shape `burstiness` and mean 1/rate (burstiness 1 is a Poisson process).

    Raises ValueError for a non-positive rate or burstiness.
    """
    if not request_rate > 0:
        raise ValueError(f"request_rate: must be positive or inf, got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness: must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    offsets, t = [], 0.0
    for _ in range(num_requests):
        offsets.append(t)
        t += rng.gammavariate(burstiness, scale)
    return offsets


def request_body_extras(
    request: SampleRequest, extra_body: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The extra JSON fields of one request: the global --extra-body plus its constraint."""
    body = dict(extra_body or {})
    if request.structured is not None:
        body.update(request.structured.request_fields())
    return body or None


async def run_requests(
    requests: Sequence[SampleRequest],
    request_func: RequestFunc,
    api_url: str,
    model: str,
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    ignore_eos: bool = False,
    extra_body: dict[str, Any] | None = None,
    temperature: float = 0.0,
    api_key: str | None = None,
    seed: int = 0,
    disable_tqdm: bool = False,
    initial_test: bool = True,
) -> RunResult:
    """Send every request on its arrival schedule and collect the outputs.

    With `initial_test`, first sends one request (not counted) and raises RuntimeError if it
    fails, so a misconfigured run stops before it starts. Raises ValueError for a bad rate,
    burstiness or concurrency.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be at least 1, got {max_concurrency}")
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    inputs = [
        RequestFuncInput(
            prompt=r.prompt,
            api_url=api_url,
            prompt_len=r.prompt_len,
            output_len=r.expected_output_len,
            model=model,
            extra_body=request_body_extras(r, extra_body),
            ignore_eos=ignore_eos,
            temperature=temperature,
            api_key=api_key,
        )
        for r in requests
    ]
    from tqdm import tqdm

    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, force_close=False)
    async with aiohttp.ClientSession(
        timeout=REQUEST_TIMEOUT, connector=connector, trust_env=False
    ) as session:
        if initial_test and inputs:
            probe = await request_func(inputs[0], session)
            if not probe.success:
                raise RuntimeError(f"initial test request failed: {probe.error}")
        limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(inputs), disable=disable_tqdm, file=sys.stderr)

        async def send(inp: RequestFuncInput) -> RequestFuncOutput:
            if limit is None:
                out = await request_func(inp, session)
            else:
                async with limit:
                    out = await request_func(inp, session)
            bar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        for inp, offset in zip(inputs, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(inp)))
        outputs = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        bar.close()
    return RunResult(outputs, duration)


def api_url(args: argparse.Namespace) -> str:
    """The request URL: --base-url + --endpoint, else http://--host:--port + --endpoint."""
    base = args.base_url.rstrip("/") if args.base_url else f"http://{args.host}:{args.port}"
    return base + "/" + args.endpoint.lstrip("/")


def base_url(args: argparse.Namespace) -> str:
    """The server root (for /v1/models and /health)."""
    return args.base_url.rstrip("/") if args.base_url else f"http://{args.host}:{args.port}"


async def fetch_model_id(root: str, api_key: str | None = None) -> str:
    """The first model id the server lists at /v1/models. Raises RuntimeError if none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(trust_env=False) as session:
        async with session.get(root + "/v1/models", headers=headers) as response:
            if response.status != 200:
                raise RuntimeError(f"GET /v1/models: HTTP {response.status}")
            data = (await response.json()).get("data") or []
    if not data:
        raise RuntimeError("GET /v1/models: the server lists no model")
    return data[0]["id"]


async def wait_until_ready(root: str, timeout_s: float, api_key: str | None = None) -> None:
    """Polls GET `root`/health until the server answers it: 200, or 404 from a server that
    has no such route (the initial test request then decides). Connection errors and other
    statuses (503 while the engine starts) are retried every 0.5 s.

    Raises RuntimeError, with the last answer, once `timeout_s` seconds have passed.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession(trust_env=False) as session:
        while True:
            remaining = deadline - time.monotonic()
            try:
                async with session.get(
                    root + "/health",
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=max(0.1, min(5.0, remaining))),
                ) as response:
                    if response.status in (200, 404):
                        return
                    last = f"HTTP {response.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(
                    f"the server at {root} was not ready within {timeout_s:g} s "
                    f"(--ready-check-timeout-sec); last attempt: {last}"
                )
            await asyncio.sleep(min(0.5, remaining))


# The server's speculative-decoding counters (vLLM's names), read before and after a run.
SPEC_DECODE_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def parse_spec_decode_counters(text: str) -> dict[str, float]:
    """The SPEC_DECODE_COUNTERS in a Prometheus text exposition, summed over labels (absent
    counters are left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in SPEC_DECODE_COUNTERS:
            totals[family.name] = sum(
                s.value for s in family.samples if s.name.endswith("_total"))
    return totals


async def read_spec_decode_counters(root: str, api_key: str | None = None) -> dict[str, float]:
    """The server's speculative-decoding counters from `root`/metrics; {} when it has no
    /metrics or no such counters (a benchmark must not fail over a report)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(trust_env=False) as session:
            async with session.get(root + "/metrics", headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=10)) as response:
                if response.status != 200:
                    return {}
                return parse_spec_decode_counters(await response.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return {}


def spec_decode_summary(
    before: dict[str, float], after: dict[str, float]
) -> dict[str, float] | None:
    """Draft acceptance over one run from counters read before and after it; None when the
    server drafted nothing meanwhile."""
    drafts, tokens, accepted = (
        after.get(name, 0.0) - before.get(name, 0.0) for name in SPEC_DECODE_COUNTERS
    )
    if tokens <= 0 or drafts <= 0:
        return None
    return {
        "draft_tokens": tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / tokens,
        "mean_accepted_length": 1 + accepted / drafts,
    }


def format_spec_decode(summary: dict[str, float] | None) -> str:
    """Report lines for spec_decode_summary's result ("" when there is none)."""
    if summary is None:
        return ""
    return (
        f"{'Draft acceptance rate:':<42}{summary['acceptance_rate']:>18.2f}\n"
        f"{'Mean accepted length:':<42}{summary['mean_accepted_length']:>18.2f}"
    )


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer of a model name as the server resolves it: a local directory or GGUF
    file, the embedded default, a demo model name, or a hub id (from the hub cache).

    Raises ValueError naming `tokenizer` if `name` is none of these.
    """
    from vllm.transformers_utils.tokenizer import get_tokenizer

    return get_tokenizer(name)


def token_counter(tokenizer: Tokenizer) -> Callable[[str], int]:
    """A function counting the tokens of a text (used when the server reports no usage)."""
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def parse_extra_body(text: str | None) -> dict[str, Any] | None:
    """Parse --extra-body. Raises ValueError unless it is a JSON object."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"extra_body: not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError("extra_body: must be a JSON object")
    return value


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `vllm bench serve` and the structured-output benchmark."""
    parser.add_argument("--backend", default="vllm", choices=BACKENDS,
                        help="Server flavour; all speak the OpenAI API.")
    parser.add_argument("--base-url", default=None,
                        help="Server root, e.g. http://127.0.0.1:8000 (overrides --host/--port).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions",
                        help="/v1/completions or /v1/chat/completions.")
    parser.add_argument("--model", default=None,
                        help="Model name to send (default: the first one /v1/models lists).")
    parser.add_argument("--tokenizer", default=None,
                        help="Tokenizer directory or demo model name (default: --model).")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Requests per second ('inf' sends all at once).")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="Gamma shape of arrival gaps: 1 is Poisson, <1 burstier.")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="Most requests in flight at once.")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="Ask the server to ignore EOS (vLLM extension).")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                        help="Comma-separated subset of ttft,tpot,itl,e2el to report.")
    parser.add_argument("--metric-percentiles", default="99",
                        help="Comma-separated percentiles, e.g. 25,50,99.")
    parser.add_argument("--goodput", nargs="+", default=None,
                        help="SLOs as NAME:MS (ttft, tpot, e2el), e.g. ttft:300 tpot:50.")
    parser.add_argument("--save-results", action="store_true")
    parser.add_argument("--result-dir", default=None)
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--api-key", default=None, help="Sent as 'Authorization: Bearer KEY'.")


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """All flags of `vllm bench serve`."""
    add_common_args(parser)
    parser.add_argument("--dataset-name", default="random", choices=["random", "custom"])
    parser.add_argument("--dataset-path", default=None,
                        help="JSONL file of {\"prompt\": ...} objects (custom dataset).")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--random-prefix-len", type=int, default=0)
    parser.add_argument("--custom-output-len", type=int, default=256)
    parser.add_argument("--no-shuffle", action="store_true",
                        help="Keep the custom dataset's order.")
    parser.add_argument("--extra-body", default=None,
                        help="JSON object merged into every request body.")
    parser.add_argument("--ready-check-timeout-sec", type=float, default=600.0,
                        help="Seconds to wait for the server to answer GET /health before the "
                        "run starts (0: do not wait; default: %(default)g).")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="Accepted for compatibility with vLLM and ignored: tokenizers load "
                        "without running code shipped with a model.")
    return parser


def check_common_args(args: argparse.Namespace) -> None:
    """Validate shared flags. Raises ValueError naming the flag."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts: must be positive, got {args.num_prompts}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate: must be positive or inf, got {args.request_rate}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness: must be positive, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency: must be positive, got {args.max_concurrency}")
    get_request_func(args.endpoint)
    parse_metric_names(args.percentile_metrics)
    parse_percentiles(args.metric_percentiles)
    parse_goodput(args.goodput)


def resolve_model(args: argparse.Namespace) -> str:
    """--model, or the server's first model id."""
    if args.model:
        return args.model
    return asyncio.run(fetch_model_id(base_url(args), args.api_key))


def summarize_run(
    args: argparse.Namespace, run: RunResult, tokenizer: Tokenizer | None
) -> BenchmarkMetrics:
    """Metrics of a finished run with the flags' percentiles and SLOs."""
    return calculate_metrics(
        run.outputs,
        run.duration_s,
        selected_metrics=parse_metric_names(args.percentile_metrics),
        percentiles=parse_percentiles(args.metric_percentiles),
        goodput=parse_goodput(args.goodput) or None,
        count_tokens=token_counter(tokenizer) if tokenizer is not None else None,
    )


def result_record(
    args: argparse.Namespace, model: str, metrics: BenchmarkMetrics, run: RunResult
) -> dict[str, Any]:
    """The JSON-ready result of a run: settings, metrics, and per-request timings."""
    outs = run.outputs
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "endpoint": args.endpoint,
        "model": model,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **metrics.to_dict(),
        "input_lens": [o.prompt_len for o in outs],
        "output_lens": [o.output_tokens for o in outs],
        "ttfts": [o.ttft for o in outs],
        "e2els": [o.latency for o in outs],
        "finish_reasons": [o.finish_reason for o in outs],
        "errors": [o.error for o in outs],
    }


def save_result(args: argparse.Namespace, record: dict[str, Any], model: str) -> Path:
    """Write `record` as JSON to --result-dir/--result-filename (a default name from the
    backend, rate, model and time). Raises OSError if it cannot be written."""
    name = args.result_filename
    if not name:
        rate = record["request_rate"]
        model_tag = Path(model).name or "model"
        name = f"{args.backend}-{rate}qps-{model_tag}-{record['date']}.json"
    path = Path(args.result_dir or ".") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path


def run_with_args(
    args: argparse.Namespace,
    requests: Sequence[SampleRequest],
    model: str,
    extra_body: dict[str, Any] | None,
) -> RunResult:
    """Send `requests` to the server the flags name, at their rate, concurrency and sampling
    settings. Raises ValueError for a bad --endpoint, RuntimeError if the server cannot be used."""
    return asyncio.run(
        run_requests(
            requests,
            get_request_func(args.endpoint),
            api_url(args),
            model,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            ignore_eos=args.ignore_eos,
            extra_body=extra_body,
            temperature=args.temperature,
            api_key=args.api_key,
            seed=args.seed,
            disable_tqdm=args.disable_tqdm,
        )
    )


def run_counting_drafts(
    args: argparse.Namespace,
    requests: Sequence[SampleRequest],
    model: str,
    extra_body: dict[str, Any] | None,
) -> tuple[RunResult, dict[str, float] | None]:
    """run_with_args, plus the server's draft acceptance over the run (spec_decode_summary of
    its counters read before and after; None when it drafted nothing)."""
    root = base_url(args)
    before = asyncio.run(read_spec_decode_counters(root, args.api_key))
    result = run_with_args(args, requests, model, extra_body)
    after = asyncio.run(read_spec_decode_counters(root, args.api_key))
    return result, spec_decode_summary(before, after)


def exit_status(action: Callable[[], object]) -> int:
    """Run a benchmark command; return its exit status: 0, or after printing the error, 2 for
    a ValueError (bad flags) and 1 for a RuntimeError (the server cannot be used)."""
    try:
        action()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run `vllm bench serve` with parsed flags; prints the report, returns the result record.

    Raises ValueError for bad flags and RuntimeError if the server cannot be used.
    """
    check_common_args(args)
    if not args.ready_check_timeout_sec >= 0:
        raise ValueError(
            f"--ready-check-timeout-sec: must be 0 or more, got {args.ready_check_timeout_sec}"
        )
    extra_body = parse_extra_body(args.extra_body)
    if args.ready_check_timeout_sec > 0:
        asyncio.run(wait_until_ready(base_url(args), args.ready_check_timeout_sec, args.api_key))
    model = resolve_model(args)
    tokenizer = load_tokenizer(args.tokenizer or model)
    if args.dataset_name == "random":
        requests = sample_random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            args.seed,
        )
    else:
        if not args.dataset_path:
            raise ValueError("--dataset-path: required with --dataset-name custom")
        requests = load_custom_requests(
            args.dataset_path,
            tokenizer,
            args.num_prompts,
            args.custom_output_len,
            shuffle=not args.no_shuffle,
            seed=args.seed,
        )
    run, spec = run_counting_drafts(args, requests, model, extra_body)
    metrics = summarize_run(args, run, tokenizer)
    print(format_report(metrics))
    if spec is not None:
        print(format_spec_decode(spec))
    record = result_record(args, model, metrics, run)
    record["spec_decode"] = spec
    if args.save_results:
        print(f"Results written to {save_result(args, record, model)}")
    return record
