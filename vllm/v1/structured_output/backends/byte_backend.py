"""The base of the backends that read the vocabulary as bytes themselves (outlines,
lm-format-enforcer; docs/architecture.md section 5): one vocabulary view built by `prepare`
(shared with forked compile workers), the engine's token facts taken from it, and the
`max_whitespace` check.

Imports no backend library.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.structured_output.backends.base import (
    BackendOptions,
    BackendSetup,
    StructuredOutputBackend,
)
from vllm.v1.structured_output.backends.vocab_bytes import VocabBytes


class VocabBackend(StructuredOutputBackend):
    """A backend whose `vocab_view` class wraps the vocabulary's bytes (`VocabBytes`) and
    exposes `vocab_size`, `stop_ids` and `masked_token_ids`.

    Raises ValueError when the tokenizer has no vocabulary, no stop token is in the
    vocabulary, or `max_whitespace` is negative.
    """

    #: The class of the vocabulary view: built from `VocabBytes`, shared by grammars.
    vocab_view: type

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        options: BackendOptions = BackendOptions(),
        prepared: Any = None,
    ) -> None:
        if options.max_whitespace is not None and options.max_whitespace < 0:
            raise ValueError(f"max_whitespace: must be >= 0 or None, got {options.max_whitespace}")
        self.options = options
        self.vocab = prepared or self.prepare(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = self.vocab.vocab_size
        self.stop_token_ids = tuple(sorted(self.vocab.stop_ids))
        self.masked_token_ids = self.vocab.masked_token_ids

    @classmethod
    def prepare(cls, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
        """The vocabulary view (seconds for 150k tokens), shared with forked workers."""
        return cls.vocab_view(VocabBytes.build(tokenizer, vocab_size, stop_token_ids))

    @classmethod
    def create(cls, setup: BackendSetup) -> VocabBackend:
        """Builds the backend, reusing `setup.prepared` when a parent process prepared it.
        Raises RuntimeError when neither the tokenizer nor a prepared view is given."""
        if setup.tokenizer is None and setup.prepared is None:
            raise RuntimeError(f"structured outputs: {cls.__name__} needs the tokenizer")
        return cls(setup.tokenizer, setup.vocab_size, setup.stop_token_ids, setup.options,
                   setup.prepared)
