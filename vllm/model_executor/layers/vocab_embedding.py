"""Token embedding and the language-model head, split by vocabulary across tensor-parallel ranks.

Each rank owns a contiguous slice of ceil(vocab_size / tp) vocabulary rows; the last slice
is padded with zero rows when the vocabulary does not divide evenly. Both layers use the
same slices, so a tied head can share the embedding's shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.parallel_state import ParallelContext
from vllm.model_executor.layers import batch_invariant_linear
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor, check_shape


class VocabShard(nn.Module):
    """A [rows_per_rank, hidden_size] slice of a [vocab_size, hidden_size] table.

    Rank t holds vocabulary rows ``vocab_start:vocab_start + num_valid``; its remaining
    ``rows_per_rank - num_valid`` rows are padding.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, parallel: ParallelContext | None = None
    ) -> None:
        super().__init__()
        self.parallel = parallel or ParallelContext.single()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.rows_per_rank = -(-vocab_size // self.parallel.tp_size)
        self.vocab_start = self.parallel.tp_rank * self.rows_per_rank
        self.num_valid = max(0, min(self.rows_per_rank, vocab_size - self.vocab_start))
        # Uninitialized on purpose: the loader overwrites it.
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size), requires_grad=False
        )

    def load_weight(
        self, param_name: str, tensor: CheckpointTensor, part: int | None = None
    ) -> None:
        """Copies this rank's rows of the full [vocab_size, hidden_size] checkpoint table
        and zeroes the padding rows.

        Raises ValueError for anything but ``weight`` or for a wrong full shape.
        """
        if param_name != "weight" or part is not None:
            raise ValueError(f"this layer has no {param_name!r} parameter part {part}")
        check_shape(tensor, (self.vocab_size, self.hidden_size))
        with torch.no_grad():
            if self.num_valid:
                rows = tensor.read_range(0, self.vocab_start, self.num_valid)
                self.weight.data[: self.num_valid].copy_(rows)
            self.weight.data[self.num_valid :].zero_()

    def extra_repr(self) -> str:
        return (
            f"vocab={self.vocab_size}, hidden={self.hidden_size}, "
            f"rows={self.vocab_start}:{self.vocab_start + self.num_valid}"
        )


class VocabParallelEmbedding(VocabShard):
    """Looks up one row of the [vocab_size, hidden_size] table per token id."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Maps [T] token ids to [T, hidden_size], the same on every tensor-parallel rank.

        Side effect (tp > 1): an all-reduce over the tensor-parallel group.
        """
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids of other ranks' slices look up row 0 and are then zeroed, so the sum over the
        # group leaves exactly the owner's row (adding zeros is exact).
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_valid)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.parallel.all_reduce(out)


class ParallelLMHead(VocabShard):
    """Projects hidden states to vocabulary logits; can share its weight with an embedding."""

    # How this head's CPU products keep each row independent of the batch (set by
    # batch_invariant_linear.plan_model); None: the plain matmul.
    row_plan: batch_invariant_linear.RowPlan | None = None

    def tie(self, embedding: VocabParallelEmbedding) -> None:
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

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Maps [N, hidden_size] to float32 logits [N, vocab_size], the full vocabulary on
        every tensor-parallel rank.

        `out`, a contiguous float32 [N, vocab_size] tensor, receives the logits (and is
        returned) when the product can be written there directly: one rank, float32 hidden
        states and weight, all on the CPU, where a fresh vocabulary-sized tensor per step
        costs page faults and unmapping. Otherwise it is ignored. Same values either way
        (F.linear without bias is this very matrix product). With a row_plan, a row's logits
        do not depend on how many rows come with it (layers/batch_invariant_linear.py).
        Side effect (tp > 1): an all-gather over the tensor-parallel group.
        """
        if out is not None and not self._writes_into(hidden, out):
            out = None
        if (self.row_plan is not None and hidden.dim() == 2
                and hidden.dtype == torch.float32 and hidden.device.type == "cpu"):
            logits = batch_invariant_linear.multiply(hidden, self.weight.t(), self.row_plan, out)
            if out is not None:
                return logits
        elif out is not None:
            return torch.mm(hidden, self.weight.t(), out=out)
        else:
            logits = F.linear(hidden, self.weight).float()
        if self.parallel.tp_size == 1:
            return logits
        full = self.parallel.all_gather(logits)
        if full.shape[-1] == self.vocab_size:
            return full
        # Drop the padding rows' logits; contiguous so callers get an ordinary tensor.
        return full[..., : self.vocab_size].contiguous()

    def _writes_into(self, hidden: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether forward can write the logits of `hidden` straight into `out`."""
        w = self.weight
        return (
            self.parallel.tp_size == 1
            and self.num_valid == self.vocab_size
            and hidden.dim() == 2
            and hidden.dtype == w.dtype == out.dtype == torch.float32
            and hidden.device.type == w.device.type == out.device.type == "cpu"
            and out.is_contiguous()
            and tuple(out.shape) == (hidden.shape[0], self.vocab_size)
        )
