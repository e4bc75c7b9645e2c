"""The vision tower of Qwen2.5-VL: patch embedding, transformer blocks with 2-D rotary
positions and windowed attention, and the patch merger that maps each square of
spatial_merge_size x spatial_merge_size patches to one language-model embedding.

Input is what the image processor (vllm/multimodal/qwen_vl_image.py) makes of one image:
[num_patches, channels * temporal_patch_size * patch_size**2] float rows, ordered merge
square by merge square (row-major over squares, row-major inside each), and its grid
(t, h, w) in patches. Every tensor-parallel rank runs the whole tower (it is small beside
the language model), so its layers are plain, replicated modules.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.layernorm import RMSNorm

# The vision towers' activations by their config names.
VISION_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def vision_activation(name: str):
    """The activation `vision_config.hidden_act` names; ValueError naming the field when
    it is not one of VISION_ACTIVATIONS."""
    if name not in VISION_ACTIVATIONS:
        raise ValueError(f"vision_config.hidden_act: {name!r} is not supported (one of "
                         f"{', '.join(VISION_ACTIVATIONS)})")
    return VISION_ACTIVATIONS[name]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionMLP(nn.Module):
    """Gated feed-forward block with biases: down(act(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.act = vision_activation(act)
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps [S, dim] to [S, dim]."""
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionAttention(nn.Module):
    """Bidirectional attention within segments of the patch sequence (windows or the whole
    image), with the 2-D rotary positions applied to queries and keys."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        """Maps [S, dim] to [S, dim]; `bounds` are the segment boundaries (0 first, S last),
        and tokens attend only within their own segment."""
        s = x.shape[0]
        q, k, v = self.qkv(x).view(s, 3, self.num_heads, self.head_dim).unbind(1)
        # The rotation runs in float32, as the reference does, whatever the model's dtype.
        c, n = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q.float() * c + _rotate_half(q.float()) * n).to(v.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * n).to(v.dtype)
        out = torch.empty_like(q)
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                seg = [t[start:end].transpose(0, 1) for t in (q, k, v)]
                out[start:end] = F.scaled_dot_product_attention(*seg).transpose(0, 1)
        return self.proj(out.reshape(s, -1))


class VisionBlock(nn.Module):
    """Pre-norm transformer block of the vision tower."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, 1e-6)
        self.norm2 = RMSNorm(config.hidden_size, 1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        """Maps [S, dim] to [S, dim]."""
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm, then an MLP over each merge square's concatenated patches: [S, dim] to
    [S / merge**2, out_dim]."""

    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.in_dim = dim * merge * merge
        self.ln_q = RMSNorm(dim, 1e-6)
        # Named as the checkpoint's nn.Sequential: mlp.0 and mlp.2 (mlp.1 is the GELU).
        self.mlp = nn.ModuleDict({"0": nn.Linear(self.in_dim, self.in_dim),
                                  "2": nn.Linear(self.in_dim, out_dim)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps [S, dim] (S a multiple of merge**2, squares consecutive) to [S/merge**2,
        out_dim]."""
        x = self.ln_q(x).view(-1, self.in_dim)
        return self.mlp["2"](F.gelu(self.mlp["0"](x)))


class PatchEmbed(nn.Module):
    """A 3-D convolution whose kernel equals its stride: one linear (or, with `bias`,
    affine) map per patch."""

    def __init__(self, config: Any, bias: bool = False) -> None:
        super().__init__()
        p, tp = config.patch_size, config.temporal_patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(
            torch.empty(config.hidden_size, config.in_channels, tp, p, p), requires_grad=False
        )
        self.proj.bias = (nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
                          if bias else None)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Maps [S, C * tp * p * p] to [S, hidden]."""
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.view(w.shape[0], -1), self.proj.bias)


class VisionRotary(nn.Module):
    """The towers' 2-D rotary positions: half of each head's rotary frequencies follow the
    patch's row, half its column (`vision_config.rope_parameters.rope_theta`, default
    10000)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        half = config.hidden_size // config.num_heads // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, rows: torch.Tensor, cols: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, [S, head_dim] float32, of the patches at (rows, cols)."""
        inv = self.inv_freq.float()
        freqs = torch.cat([rows.float()[:, None] * inv, cols.float()[:, None] * inv], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()


def check_grid(pixels: torch.Tensor, grid_thw: tuple[int, int, int], merge: int) -> None:
    """ValueError when an image's grid (t, h, w) does not divide into merge squares or
    does not match its rows of patches."""
    t, h, w = grid_thw
    if h % merge or w % merge or pixels.shape[0] != t * h * w:
        raise ValueError(f"image grid {grid_thw} does not match its {pixels.shape[0]} "
                         f"patches in squares of {merge}")


def patch_coordinates(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each patch of an h x w grid, in the processor's order: merge
    squares row-major, patches row-major inside each square."""
    rows = torch.arange(h).view(h // merge, 1, merge, 1).expand(h // merge, w // merge,
                                                                merge, merge)
    cols = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, w // merge,
                                                                merge, merge)
    return rows.reshape(-1), cols.reshape(-1)


def window_order(t: int, h: int, w: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merge squares of a t x h x w grid (in squares) regrouped by attention window
    (windows of `window` x `window` squares, row-major; squares row-major inside each):
    returns the square index of each position and the windows' sizes in squares."""
    index = torch.arange(t * h * w).view(t, h, w)
    order: list[torch.Tensor] = []
    sizes: list[int] = []
    for frame in range(t):
        for r in range(0, h, window):
            for c in range(0, w, window):
                part = index[frame, r:r + window, c:c + window].reshape(-1)
                order.append(part)
                sizes.append(part.numel())
    return torch.cat(order), sizes


class Qwen2_5_VisionTransformer(nn.Module):
    """Maps one image's patches to its language-model embeddings
    [t * h * w / merge**2, out_hidden_size]."""

    # Its products see one image's patches, never a step's token rows: the runner's row
    # padding ignores them (layers/column_major.py), on every pipeline stage alike.
    multiplies_step_rows = False

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.patch_size = config.patch_size
        self.window_size = config.window_size
        self.full_attention = set(config.fullatt_block_indexes or ())
        self.patch_embed = PatchEmbed(config)
        self.rotary = VisionRotary(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config.out_hidden_size, config.hidden_size, self.merge)

    def forward(self, pixels: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """Embeds one image: pixels [t * h * w, patch_dim] with grid (t, h, w) in patches.
        Raises ValueError when the grid does not divide into merge squares."""
        t, h, w = grid_thw
        m = self.merge
        check_grid(pixels, grid_thw, m)
        unit = m * m
        device = self.rotary.inv_freq.device
        rows, cols = patch_coordinates(h, w, m)
        cos, sin = self.rotary(rows.repeat(t).to(device), cols.repeat(t).to(device))
        squares, sizes = window_order(t, h // m, w // m,
                                      self.window_size // m // self.patch_size)
        # Patch order grouped by window: every square's patches stay together.
        perm = (squares.to(device)[:, None] * unit + torch.arange(unit, device=device)).view(-1)
        x = self.patch_embed(pixels)[perm]
        cos, sin = cos[perm], sin[perm]
        window_bounds = [0]
        for size in sizes:
            window_bounds.append(window_bounds[-1] + size * unit)
        frame = h * w
        full_bounds = list(range(0, t * frame + 1, frame))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full_bounds if i in self.full_attention else window_bounds)
        merged = self.merger(x)
        # Back to the processor's square order.
        out = torch.empty_like(merged)
        out[squares.to(device)] = merged
        return out
