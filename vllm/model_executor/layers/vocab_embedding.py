"""Token embedding and the language-model head, optionally sharing one matrix."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """Looks up one row of a [vocab_size, hidden_size] table per token id."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Maps [T] token ids to [T, hidden_size]."""
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; can share its weight with an embedding."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def tie(self, embedding: VocabEmbedding) -> None:
        """Makes this head use the embedding's matrix (tie_word_embeddings).

        Side effect: replaces this module's weight parameter with the embedding's.
        Raises ValueError if the shapes differ.
        """
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(
                f"tie_word_embeddings: embedding shape {tuple(embedding.weight.shape)} differs "
                f"from lm_head shape {tuple(self.weight.shape)}"
            )
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Maps [N, hidden_size] to float32 logits [N, vocab_size]."""
        return F.linear(hidden, self.weight).float()
