"""The grammar oracle (docs/architecture.md §9) for engine-level tests.

Every token of a structured output must be accepted by a fresh matcher, and an output that
finished with reason "stop" must satisfy its constraint checked independently of xgrammar's
matcher where possible: jsonschema for JSON, re.fullmatch for regexes, membership for choices.
"""

from __future__ import annotations

import functools
import json
import re
from decimal import Decimal
from fractions import Fraction
from typing import Any

import jsonschema

from vllm.outputs import CompletionOutput
from vllm.sampling_params import StructuredOutputsParams

_EOS_IDS = (151645, 151643)
_VOCAB_SIZE = 151_936


@functools.lru_cache(maxsize=4)
def _backend(tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]):
    """The engine's default backend (auto: xgrammar, else llguidance), built afresh."""
    from vllm.config import StructuredOutputsConfig
    from vllm.v1.structured_output.backends.auto import create_backend

    return create_backend(StructuredOutputsConfig(), tokenizer, vocab_size, list(eos_ids))


def oracle_backend(tokenizer: Any, vocab_size: int = _VOCAB_SIZE,
                   eos_ids: tuple[int, ...] = _EOS_IDS):
    """The backend the oracle compiles with (one per process and vocabulary, never the
    engine's): a test that compiles the same constraints first shares its compiles."""
    return _backend(tokenizer, vocab_size, tuple(eos_ids))


def _exact_multiple_of(validator: Any, divisor: Any, instance: Any, schema: Any) -> Any:
    """`multipleOf` on the numbers' decimal values, as JSON Schema defines it: jsonschema
    divides binary floats, so it calls 4937.49 no multiple of 0.01 (493748.99999999994)."""
    if not validator.is_type(instance, "number"):
        return
    # Fractions, not Decimal division: a walk may write 1e300, past Decimal's precision.
    if (Fraction(Decimal(repr(instance))) / Fraction(Decimal(repr(divisor)))).denominator != 1:
        yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {divisor!r}")


def validate_json(value: Any, schema: dict[str, Any], format_checker: Any = None) -> None:
    """Raises jsonschema.ValidationError unless `value` satisfies `schema` under the rules
    of the schema's own `$schema` draft (with an exact `multipleOf`; formats asserted only
    with a `format_checker`)."""
    exact = _exact(jsonschema.validators.validator_for(schema))
    exact(schema, format_checker=format_checker).validate(value)


@functools.cache
def _exact(draft: Any) -> Any:
    """`draft`'s validator class with the exact `multipleOf` (built once: building a class
    costs a millisecond, more than most validations)."""
    return jsonschema.validators.extend(draft, {"multipleOf": _exact_multiple_of})


def check_structured_output(
    params: StructuredOutputsParams, completion: CompletionOutput, tokenizer: Any,
    vocab_size: int = _VOCAB_SIZE, eos_ids: tuple[int, ...] = _EOS_IDS,
) -> None:
    """Asserts the oracle for one completion (of a demo-vocabulary model unless
    `vocab_size` and `eos_ids` say otherwise)."""
    assert completion.finish_reason != "error", completion.error
    grammar = _backend(tokenizer, vocab_size, tuple(eos_ids)).compile_grammar(params)
    assert grammar.accept_tokens("oracle", list(completion.token_ids)), completion.token_ids
    if completion.finish_reason != "stop":
        return
    text = completion.text
    kind = params.kind
    if kind == "json":
        schema = params.json if isinstance(params.json, dict) else json.loads(params.json)
        # Validated by the rules of the schema's own `$schema` draft.
        validate_json(json.loads(text), schema)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(params.regex, text), text
    elif kind == "choice":
        assert text in params.choice, text
    elif kind == "grammar" and "::=" in params.grammar:  # EBNF (Lark is checked by tokens)
        from xgrammar import Grammar
        from xgrammar.testing import _is_grammar_accept_string

        assert _is_grammar_accept_string(Grammar.from_ebnf(params.grammar), text), text
