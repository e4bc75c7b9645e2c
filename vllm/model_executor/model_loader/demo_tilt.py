"""The demo models' tilt toward closing characters (docs/architecture.md §7).

Plain random weights give every token about the same logit, so a constrained request's
strings, numbers and arrays almost never end: sampling picks among ~150k tokens that all
continue a string, and greedy decoding repeats one of them. The tilt makes the closing
tokens (`"`, `}`, `]`, `",`, `"}` ... as the vocabulary has them) much likelier, using only
tensors a Qwen3 checkpoint already has (it has no LM-head bias):

- the last hidden dimension is a constant channel: every token embedding holds `CONSTANT`
  there, and no `o_proj` or `down_proj` writes to it, so the residual stream keeps it and the
  final RMSNorm turns it into a near-constant positive value;
- the embedding is tied to the LM head, so a closing token's row holding more in that column
  (`CONSTANT` plus a margin) is a per-token logit bias, sized to about `ln(vocab) + 1` or
  more: then a closing token alone outweighs all other tokens together at temperature 1;
- the bias comes in tiers: tokens starting with a quote, then brackets (inside a JSON string
  a bracket is text, so the quote must win there under greedy decoding), then the separators
  `@`, `.`, `,` and `,"`, so that a number followed by more keys, or a run of word characters
  in a regex such as `\\w+@\\w+\\.com`, moves on.

The channel does not dominate everywhere: `demo-small-vocab-deep`'s wide layers write more
than it holds, so its tilt is weaker (greedy decoding still closes).

EOS is not tilted: free text still runs to its length limit, and a finished JSON value
leaves only EOS allowed anyway. Free text from a tilted demo is mostly closing characters.
"""

from __future__ import annotations

import math

import torch

# Closing pieces, each one token of Qwen's vocabulary (those a reduced vocabulary lacks are
# skipped), in tiers of falling bias. Quotes first: inside a JSON string a bracket is just
# text, so under greedy decoding a quote must beat it there.
QUOTES = ('"', '",', '"}', '"]', '"},', '"]}', '"}}', '"],')
BRACKETS = ("}", "]", "},", "}]", "]}", "],", "}}", "]]", "}],")
CLOSERS = QUOTES + BRACKETS
SEPARATORS = ("@", ".", ",", ',"')
# Each tier's bias as a share of the quotes' bias; the gaps (a logit or more) exceed the
# random spread among the tilted tokens, so the order holds under greedy decoding.
SHARES = ((QUOTES, 1.0), (BRACKETS, 0.85), (SEPARATORS, 0.7))
# Value of the constant channel in every embedding: large against the random entries
# (std 0.02) and the layers' writes, so the channel dominates the final norm.
CONSTANT = 4.0
# The layers' writes still take a share of the final norm; this factor makes up for it.
MARGIN_BOOST = 1.5


def piece_ids(pieces: tuple[str, ...], ranks: dict[bytes, int],
              num_base_tokens: int) -> list[int]:
    """Ids of the `pieces` that are tokens among the first `num_base_tokens` BPE ranks."""
    ids = (ranks.get(piece.encode("utf-8")) for piece in pieces)
    return sorted(i for i in ids if i is not None and i < num_base_tokens)


def closer_ids(ranks: dict[bytes, int], num_base_tokens: int) -> list[int]:
    """Ids of the CLOSERS that are tokens among the first `num_base_tokens` BPE ranks."""
    return piece_ids(CLOSERS, ranks, num_base_tokens)


def tilt(weights: dict[str, torch.Tensor], ranks: dict[bytes, int], num_base_tokens: int,
         num_layers: int) -> None:
    """Tilt seeded random Qwen3 weights (tied head) toward the tokens of SHARES among the
    first `num_base_tokens` ranks of `ranks`; changes `weights` in place.

    Reserves the last hidden dimension as the constant channel described above. Raises
    KeyError if `weights` lacks a tensor a Qwen3 checkpoint has.
    """
    embed = weights["model.embed_tokens.weight"]
    vocab, hidden = embed.shape
    channel = hidden - 1
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        weights[prefix + "self_attn.o_proj.weight"][channel, :] = 0.0
        weights[prefix + "mlp.down_proj.weight"][channel, :] = 0.0
    weights["model.norm.weight"][channel] = 1.0
    # A dominant channel comes out of the final norm at about sqrt(hidden).
    margin = MARGIN_BOOST * (math.log(vocab) + 1.0) / math.sqrt(hidden)
    embed[:, channel] = CONSTANT
    for pieces, share in SHARES:
        embed[piece_ids(pieces, ranks, num_base_tokens), channel] += share * margin
