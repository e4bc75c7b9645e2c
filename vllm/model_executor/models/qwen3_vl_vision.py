"""The vision tower of Qwen3-VL: a biased patch embedding plus a learned position table
resampled to each image's grid, transformer blocks with LayerNorm and 2-D rotary positions
attending over the whole image, the patch merger, and the DeepStack mergers that turn the
output of chosen blocks into extra embeddings for the first language-model layers.

Input is what the image processor (vllm/multimodal/qwen_vl_image.py) makes of one image:
[num_patches, channels * temporal_patch_size * patch_size**2] rows in merge-square order,
and its grid (t, h, w) in patches. Every tensor-parallel rank runs the whole tower.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.models.qwen2_5_vl_vision import (
    PatchEmbed,
    VisionAttention,
    VisionBlock,
    VisionRotary,
    check_grid,
    patch_coordinates,
    vision_activation,
)


class Qwen3VisionMLP(nn.Module):
    """Two biased linear maps around the activation: fc2(act(fc1(x)))."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.act = vision_activation(act)
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps [S, dim] to [S, dim]."""
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(VisionBlock):
    """Qwen2.5-VL's pre-norm block (its forward) with LayerNorms that have a bias and the
    two-layer MLP."""

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = Qwen3VisionMLP(config.hidden_size, config.intermediate_size,
                                  config.hidden_act)


class Qwen3PatchMerger(nn.Module):
    """LayerNorm and an MLP over each merge square's concatenated patches: [S, dim] to
    [S / merge**2, out_dim]. The main merger normalizes each patch before the squares are
    concatenated; the DeepStack ones (`after_concat`) normalize the concatenation."""

    def __init__(self, dim: int, out_dim: int, merge: int, after_concat: bool) -> None:
        super().__init__()
        self.in_dim = dim * merge * merge
        self.after_concat = after_concat
        self.norm = nn.LayerNorm(self.in_dim if after_concat else dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.in_dim, self.in_dim)
        self.linear_fc2 = nn.Linear(self.in_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps [S, dim] (squares consecutive) to [S / merge**2, out_dim]."""
        if self.after_concat:
            x = self.norm(x.reshape(-1, self.in_dim))
        else:
            x = self.norm(x).reshape(-1, self.in_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def _axis_taps(index: torch.Tensor, size: int, side: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Linear interpolation along one axis with the corners aligned: positions 0 and
    size - 1 of the image map onto entries 0 and side - 1 of the table. Returns the lower
    and upper table entry of each index and the upper one's weight."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    low = src.floor()
    upper_weight = src - low
    low_i = low.long().clamp(0, side - 1)
    high_i = (low.long() + 1).clamp(0, side - 1)
    return low_i, high_i, upper_weight


class Qwen3VisionTransformer(nn.Module):
    """Maps one image's patches to its language-model embeddings and DeepStack embeddings:
    ([n, out_hidden_size], one [n, out_hidden_size] per deepstack_visual_indexes entry, in
    block order), n = t * h * w / merge**2."""

    # As Qwen2.5-VL's tower: its products never see a step's token rows.
    multiplies_step_rows = False

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config, bias=True)
        self.rotary = VisionRotary(config)
        self.num_position_embeddings = config.num_position_embeddings
        self.side = int(config.num_position_embeddings ** 0.5)
        if self.side * self.side != config.num_position_embeddings:
            raise ValueError(f"vision_config.num_position_embeddings: "
                             f"{config.num_position_embeddings} is not a square")
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen3PatchMerger(config.hidden_size, config.out_hidden_size,
                                       self.merge, after_concat=False)
        self.deepstack_indexes = [int(i) for i in config.deepstack_visual_indexes or ()]
        bad = [i for i in self.deepstack_indexes if not 0 <= i < config.depth]
        if bad:
            raise ValueError(f"vision_config.deepstack_visual_indexes: {bad[0]} is not a "
                             f"block of the {config.depth}-block tower")
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(config.hidden_size, config.out_hidden_size, self.merge,
                             after_concat=True)
            for _ in self.deepstack_indexes)

    def _positions(self, rows: torch.Tensor, cols: torch.Tensor, h: int, w: int
                   ) -> torch.Tensor:
        """The learned position table resampled bilinearly to an h x w grid, at the
        given patches: [S, hidden]."""
        r0, r1, wr = _axis_taps(rows, h, self.side)
        c0, c1, wc = _axis_taps(cols, w, self.side)
        table = self.pos_embed.weight
        out = (table[r0 * self.side + c0] * ((1 - wr) * (1 - wc))[:, None]
               + table[r0 * self.side + c1] * ((1 - wr) * wc)[:, None]
               + table[r1 * self.side + c0] * (wr * (1 - wc))[:, None]
               + table[r1 * self.side + c1] * (wr * wc)[:, None])
        return out

    def forward(self, pixels: torch.Tensor, grid_thw: tuple[int, int, int]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Embeds one image: pixels [t * h * w, patch_dim] with grid (t, h, w) in patches.
        Raises ValueError when the grid does not divide into merge squares."""
        t, h, w = grid_thw
        check_grid(pixels, grid_thw, self.merge)
        device = self.rotary.inv_freq.device
        rows, cols = patch_coordinates(h, w, self.merge)
        rows, cols = rows.repeat(t).to(device), cols.repeat(t).to(device)
        x = self.patch_embed(pixels)
        x = x + self._positions(rows, cols, h, w).to(x.dtype)
        cos, sin = self.rotary(rows, cols)
        # Each frame attends within itself (a still image is one frame).
        bounds = list(range(0, t * h * w + 1, h * w))
        deepstack: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, bounds)
            if i in self.deepstack_indexes:
                merger = self.deepstack_merger_list[self.deepstack_indexes.index(i)]
                deepstack.append(merger(x))
        return self.merger(x), deepstack
