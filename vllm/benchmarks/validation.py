"""Checks that each structured output satisfies its constraint (schema, regex, choice, grammar)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from vllm.benchmarks.datasets import StructuredSpec
from vllm.benchmarks.endpoint_request_func import RequestFuncOutput


@dataclass
class CorrectnessReport:
    """How many structured requests produced a valid output (unconstrained ones excluded)."""

    num_structured: int
    num_valid: int
    # Structured requests that finished with reason "stop", and how many of those are valid.
    num_stopped: int
    num_stopped_valid: int

    @property
    def rate(self) -> float | None:
        """Valid outputs / structured requests (failed requests count as invalid)."""
        return self.num_valid / self.num_structured if self.num_structured else None

    @property
    def stopped_rate(self) -> float | None:
        """Valid outputs among structured requests that stopped by themselves (not by length)."""
        return self.num_stopped_valid / self.num_stopped if self.num_stopped else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict including both rates."""
        return {
            "num_structured": self.num_structured,
            "num_valid": self.num_valid,
            "num_stopped": self.num_stopped,
            "num_stopped_valid": self.num_stopped_valid,
            "correct_rate": self.rate,
            "stopped_correct_rate": self.stopped_rate,
        }


def is_valid(text: str, spec: StructuredSpec) -> bool:
    """True if `text` satisfies `spec`: a JSON document valid under the schema (jsonschema),
    a full regex match, exactly one of the choices, or a string the EBNF grammar accepts."""
    if spec.kind == "json":
        return _valid_json(text, spec.value)
    if spec.kind == "regex":
        return re.fullmatch(spec.value, text) is not None
    if spec.kind == "choice":
        return text in spec.value
    return _grammar_accepts(spec.value, text)


def evaluate(
    outputs: Sequence[RequestFuncOutput], specs: Sequence[StructuredSpec | None]
) -> tuple[CorrectnessReport, list[bool | None]]:
    """Validate every structured request's output; returns the report and, per request,
    True/False (None for unconstrained requests). Raises ValueError on length mismatch."""
    if len(outputs) != len(specs):
        raise ValueError(f"specs: {len(specs)} given for {len(outputs)} outputs")
    verdicts: list[bool | None] = []
    n = valid = stopped = stopped_valid = 0
    for out, spec in zip(outputs, specs):
        if spec is None:
            verdicts.append(None)
            continue
        ok = out.success and is_valid(out.generated_text, spec)
        verdicts.append(ok)
        n += 1
        valid += ok
        if out.success and out.finish_reason == "stop":
            stopped += 1
            stopped_valid += ok
    return CorrectnessReport(n, valid, stopped, stopped_valid), verdicts


def _valid_json(text: str, schema: Any) -> bool:
    import jsonschema

    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        return False
    if isinstance(schema, str):
        schema = json.loads(schema)
    validator_cls = jsonschema.validators.validator_for(schema)
    return validator_cls(schema).is_valid(document)


@lru_cache(maxsize=64)
def _compiled_grammar(grammar: str) -> Any:
    import xgrammar as xgr

    # An empty vocabulary: this matcher only checks strings, it never sees token ids.
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)
    return compiler.compile_grammar(grammar)


def _grammar_accepts(grammar: str, text: str) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(_compiled_grammar(grammar), terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()
