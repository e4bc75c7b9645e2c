"""The flags of `vllm serve` and of `python -m vllm.entrypoints.openai.api_server` (upstream's
module name for them): the server's own flags, then one per EngineArgs field."""

from __future__ import annotations

import argparse
import json
import logging
import os

# The help texts of `vllm serve` and of `python -m vllm.entrypoints.openai.api_server`.
SERVE_DESCRIPTION = (
    "Start the OpenAI-compatible API server. With no MODEL, serves the built-in demo model."
)
SERVE_EPILOG = (
    "Flags are spelled as in vLLM: underscores or dashes (--max_model_len=8192), -tp/-pp "
    "with a space or '=', and any unambiguous prefix of a flag (--gpu-memory-util). A vLLM "
    "flag this engine does not implement is refused by name. "
    "Environment: the engine gives each worker one OpenMP thread per CPU it may use (CPUs "
    "shared among workers) and makes idle threads sleep; OMP_NUM_THREADS and "
    "OMP_WAIT_POLICY, when set, override that."
)


def _json_list(text: str) -> list[str]:
    """A flag's JSON list of strings (argparse reports the ValueError as a usage error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError("must be a JSON list of strings")
    return value


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the flags of `vllm serve` (server flags, then one per EngineArgs field) to
    `parser`, which `run_serve` can then run; returns it.

    `python -m vllm.entrypoints.openai.api_server` builds its parser with this too.
    """
    from vllm.engine.arg_utils import EngineArgs, parse_bytes
    from vllm.entrypoints.openai.protocol import DEFAULT_MAX_BODY_BYTES
    from vllm.entrypoints.openai.tools import TOOL_CALL_PARSERS, TOOL_CALL_STRICT_LEVELS

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="Model directory, .gguf file, hub id ORG/NAME or demo model "
                        "(default: HuggingFaceTB/SmolLM2-135M-Instruct; see --model).")
    parser.add_argument("--model", dest="model", default=None,
                        help="Same as the positional MODEL.")
    parser.add_argument("--host", default=None, help="Host to bind (default: all interfaces).")
    parser.add_argument("--port", type=int, default=8000, help="Port (0 picks a free one).")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                        help="Require 'Authorization: Bearer KEY' on /v1 routes "
                        "(default: $VLLM_API_KEY).")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level.")
    parser.add_argument("--max-request-body-bytes", type=parse_bytes,
                        default=DEFAULT_MAX_BODY_BYTES,
                        help="Largest request body accepted, e.g. 16MiB; larger ones get "
                        "a 413 (default: %(default)s bytes).")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="Do not log each request.")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='Allow tool_choice "auto": the model decides whether to call '
                        "tools, and --tool-call-parser reads the calls out of its text.")
    parser.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                        help="How the model writes tool calls: hermes (Qwen 2.5/3: "
                        "<tool_call>{json}</tool_call>), qwen3_xml / qwen3_coder (Qwen3-Coder: "
                        "<function=...><parameter=...>), mistral ([TOOL_CALLS][...]), "
                        "llama3_json (Llama 3.1+: {\"name\", \"parameters\"}); needed by "
                        "--enable-auto-tool-choice.")
    parser.add_argument("--tool-call-strict", default="off", choices=TOOL_CALL_STRICT_LEVELS,
                        help="Server policy for tool calls whatever the client sent: function "
                        "(every call names a requested tool and its arguments follow that "
                        "tool's parameters schema, as if every tool were strict), parameter "
                        "(also no properties beyond the listed ones), off (only tools the "
                        "client marks strict; default).")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="The chat template of chat requests (and /v1/responses, "
                        "/tokenize messages) instead of the model's: a Jinja file, or the "
                        "template itself inline; checked at startup.")
    parser.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                        help="Variables every chat template rendering gets, a JSON object "
                        "(e.g. '{\"enable_thinking\": false}'); a request's "
                        "chat_template_kwargs override them.")
    for flag, why in NO_EFFECT_SERVE_FLAGS.items():
        parser.add_argument(flag, action="store_true",
                            help=f"(no effect here: {why}).")
    parser.add_argument("--max-waiting-requests", type=int, default=None, metavar="N",
                        help="Overload bound: with N requests per engine already waiting "
                        "(counted from their first byte) beyond what the engines run at once "
                        "(--max-num-seqs per engine), new completion, "
                        "chat and responses requests get a 503 with Retry-After at once "
                        "instead of queuing (default: no bound).")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="Graceful shutdown: after SIGTERM or Ctrl-C the server refuses new "
                        "requests (503 with Retry-After) and lets running requests finish for up "
                        "to this many seconds, then ends the rest with an error; a second signal "
                        "ends them at once (default: 5).")
    parser.add_argument("--send-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="A client that reads nothing of its response for this long (its "
                        "socket buffers full) is dropped: the response ends and its requests "
                        "are aborted, freeing their KV cache (default: 60, as nginx's "
                        "send_timeout; 0: never).")
    parser.add_argument("--ssl-keyfile", default=None, help="Serve HTTPS: the key file.")
    parser.add_argument("--ssl-certfile", default=None,
                        help="Serve HTTPS: the certificate file (with --ssl-keyfile).")
    parser.add_argument("--allowed-origins", type=_json_list, default=[],
                        help='CORS: origins that may call the API from a browser, a JSON list '
                        '(e.g. \'["https://app.example"]\' or \'["*"]\'; default: none).')
    parser.add_argument("--allowed-methods", type=_json_list, default=["*"],
                        help="CORS: allowed methods, a JSON list (default: all).")
    parser.add_argument("--allowed-headers", type=_json_list, default=["*"],
                        help="CORS: allowed headers, a JSON list (default: all).")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: allow credentials.")
    parser.add_argument("--root-path", default="",
                        help="The path prefix a proxy serves the API under (ASGI root_path).")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="MODULE",
                        help="LoRA adapters served as models of their own (needs "
                        "--enable-lora): name=path, or JSON {\"name\": ..., \"path\": ..., "
                        "\"base_model_name\": ...}; a request picks one by its `model`.")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="Add /v1/load_lora_adapter and /v1/unload_lora_adapter (with "
                        "--enable-lora), as VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 does. Paths "
                        "load only from inside the directories holding the --lora-modules "
                        "adapters and each --lora-allowed-dir.")
    parser.add_argument("--lora-allowed-dir", action="append", default=[], metavar="DIR",
                        help="A directory runtime-loaded adapters may come from (repeatable; "
                        "symlinks leading out of it are refused).")
    EngineArgs.add_cli_args(parser)
    return parser


# Upstream `vllm serve` flags accepted so that its command lines run here unchanged; each
# changes nothing, for the reason given (shown in --help, and logged once when given).
NO_EFFECT_SERVE_FLAGS = {
    "--disable-frontend-multiprocessing":
        "the API server always runs in this process, the engine core in its own",
    "--enable-prompt-tokens-details":
        "usage reports no prompt_tokens_details (cached-token counts) here",
    "--log-error-stack":
        "request errors are returned and logged as one-line messages",
}


def warn_no_effect_flags(args: argparse.Namespace) -> list[str]:
    """Logs one warning per no-effect serve flag that was given; returns those flags."""
    given = [f for f in NO_EFFECT_SERVE_FLAGS
             if getattr(args, f[2:].replace("-", "_"), False)]
    for flag in given:
        logging.getLogger(__name__).warning(
            "%s has no effect here: %s", flag, NO_EFFECT_SERVE_FLAGS[flag])
    return given
