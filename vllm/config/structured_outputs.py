"""The structured-output options of a server (`StructuredOutputsConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm.options import grammar_server_choices, parse_fast_forward
from vllm.reasoning import PARSERS


@dataclass
class StructuredOutputsConfig:
    """Structured-output backend options (CLI: `--structured-outputs-config.NAME VALUE`).

    The limits bound what one request may ask of the grammar compiler; a constraint over a
    limit is rejected with a 400 naming the option, before anything is compiled.
    """

    # "auto": per request, the first backend (in the order of GRAMMAR_BACKENDS in options.py:
    # xgrammar, then llguidance) that enforces every part of the constraint, else a 400
    # naming what none enforces; "outlines" and "lm-format-enforcer" only for requests that
    # name them. A backend's name ("xgrammar", "guidance", "outlines",
    # "lm-format-enforcer"): that one only.
    backend: str = "auto"
    # With "auto": use xgrammar only (a constraint it cannot enforce is refused).
    disable_fallback: bool = False
    # Seconds a grammar may spend compiling before its request fails. Only the compile counts:
    # time spent waiting for a free compile worker does not.
    compile_timeout_s: float = 10.0
    # No whitespace between JSON tokens. None (not given): the model's default, which
    # EngineArgs resolves: on for the built-in demo models (their random weights would fill
    # every place JSON allows whitespace; demos.serves_compact_json), off for any
    # other model, as upstream. Read as off where it is still None.
    disable_any_whitespace: bool | None = None
    # Most whitespace characters in one run between JSON tokens (a request's `max_whitespace`
    # overrides it). Bounded so that a weak model cannot spend its whole output on spaces;
    # 16 leaves room for pretty-printed JSON nested seven levels deep.
    max_whitespace: int | None = 16
    # Treat a `oneOf` whose branches may overlap as `anyOf` (outputs may then match several
    # branches). Off: such a schema is refused; provably disjoint branches always work.
    one_of_as_any_of: bool = False
    # Every JSON schema's objects get `additionalProperties: false` where they say nothing
    # about extra keys, as a request's own `disable_additional_properties` asks (upstream's
    # option): outputs then hold only the properties a schema lists.
    disable_additional_properties: bool = False
    # How replies mark their thinking (qwen3, deepseek_r1; `vllm serve --reasoning-parser`):
    # the constraint applies only to the answer after `</think>` (docs/architecture.md §5).
    reasoning_parser: str | None = None
    # --reasoning-parser-plugin: a Python file imported before `reasoning_parser` is looked
    # up (here, and again in each engine-core process), so the parsers it registers with
    # `@ReasoningParserManager.register_module("name")` can be named.
    reasoning_parser_plugin: str | None = None
    # With a reasoning parser, constrain the thinking too: the grammar applies from the
    # reply's first token, as if there were no reasoning parser (the server still splits
    # the text into reasoning and content). Off: only the answer after `</think>`.
    enable_in_reasoning: bool = False
    # Compile workers: processes that check constraints in the API server (a worker past the
    # time limit is killed), and threads per lane in the engine. None: half the CPUs this
    # process may run on, at least 2 and at most 8.
    compile_workers: int | None = None
    # Longest constraint, in characters: the JSON text of a schema or structural tag, a regex,
    # a grammar, or all choices together. Real-world schemas are a few KB; 256 KiB leaves room.
    max_constraint_length: int = 262_144
    # Most values of all `enum` lists of one schema (or structural tag) together, and most
    # options of a `choice`. xgrammar's compile time grows faster than linearly with them
    # (10,000 values take seconds).
    max_enum_values: int = 8_192
    # Deepest nesting of objects and arrays in a JSON constraint (a schema nested 64 levels
    # deep is about 128). Compile time grows quickly with depth.
    max_json_depth: int = 128
    # Grammar fast-forward (vllm/v1/structured_output/fast_forward.py): the tokens a constrained
    # request's grammar forces next (a JSON key, `": "`, a closing brace) enter the next
    # forward pass together. "exact": the tokens a position allows alone, never sampled,
    # outputs exactly those without it; "canonical": the forced text tokenized by the
    # engine's tokenizer, each token the only one its position allows (valid, not
    # token-identical); "off". true/false mean exact/off. Anything but off implies
    # speculative decoding with method "grammar" unless --speculative-config is given (whose
    # drafts then start with the exact tokens). It is also the most a request's own
    # `structured_outputs.fast_forward` may ask for. Off by default (docs/architecture.md
    # §11): exact mode appends few tokens with a byte-level BPE vocabulary and turns decode
    # steps into multi-token steps (no decode graph on CUDA), and canonical mode changes
    # outputs, which only the operator may allow.
    fast_forward: str = "off"

    def __post_init__(self) -> None:
        self.fast_forward = parse_fast_forward(
            self.fast_forward, "--structured-outputs-config.fast_forward")
        if self.backend not in grammar_server_choices():
            raise ValueError(
                f"--structured-outputs-config.backend: {self.backend!r} is not one of "
                f"{', '.join(grammar_server_choices())}"
            )
        self.import_reasoning_parser_plugin()
        if not isinstance(self.enable_in_reasoning, bool):
            raise ValueError(
                "--structured-outputs-config.enable_in_reasoning: must be true or false, got "
                f"{self.enable_in_reasoning!r}"
            )
        if not isinstance(self.disable_additional_properties, bool):
            raise ValueError(
                "--structured-outputs-config.disable_additional_properties: must be true or "
                f"false, got {self.disable_additional_properties!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in PARSERS:
            raise ValueError(
                f"--reasoning-parser: {self.reasoning_parser!r} is not one of "
                f"{', '.join(sorted(PARSERS))}"
            )
        if (
            isinstance(self.compile_timeout_s, bool)
            or not isinstance(self.compile_timeout_s, (int, float))
            or not 0 < self.compile_timeout_s < float("inf")
        ):
            raise ValueError(
                "--structured-outputs-config.compile_timeout_s: must be a positive number of "
                f"seconds, got {self.compile_timeout_s!r}"
            )
        optional = ("compile_workers",) if self.compile_workers is None else ()
        for name in ("compile_workers", "max_constraint_length", "max_enum_values",
                     "max_json_depth"):
            if name in optional:
                continue
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"--structured-outputs-config.{name}: must be a positive integer, "
                    f"got {value!r}"
                )

        from vllm.sampling_params import MAX_WHITESPACE_LIMIT

        if self.max_whitespace is not None and (
            isinstance(self.max_whitespace, bool)
            or not isinstance(self.max_whitespace, int)
            or not 0 <= self.max_whitespace <= MAX_WHITESPACE_LIMIT
        ):
            raise ValueError(
                "--structured-outputs-config.max_whitespace: must be an integer in "
                f"[0, {MAX_WHITESPACE_LIMIT}] or null, got {self.max_whitespace!r}"
            )

    def import_reasoning_parser_plugin(self) -> None:
        """Imports `reasoning_parser_plugin` (once per process; no-op without one), running
        the user's module so its parsers register. Raises ValueError naming
        --reasoning-parser-plugin when the file is missing or fails to import."""
        if self.reasoning_parser_plugin:
            from vllm.reasoning import ReasoningParserManager

            ReasoningParserManager.import_reasoning_parser(self.reasoning_parser_plugin)
            # Absolute, so an engine-core process finds it whatever its working directory.
            self.reasoning_parser_plugin = str(
                Path(self.reasoning_parser_plugin).expanduser().resolve())

    @property
    def num_compile_workers(self) -> int:
        """`compile_workers`, or the default derived from this process's CPU affinity."""
        if self.compile_workers is not None:
            return self.compile_workers
        from vllm import thread_policy

        return thread_policy.helper_threads()
