"""Multimodal rotary embedding (M-RoPE, Qwen2-VL, Qwen2.5-VL and Qwen3-VL).

Each token has three positions, temporal, height and width. Qwen2(.5)-VL cut the rotary
frequencies into three consecutive sections (`mrope_section`, in frequency pairs), and
section k rotates by position k. Qwen3-VL interleaves them instead: frequency j follows the
height when j % 3 == 1 and j < 3 * section[1], the width when j % 3 == 2 and
j < 3 * section[2], and the temporal position otherwise, so every axis gets high and low
frequencies alike. A text token has the same value in all three, so on text alone M-RoPE is
plain RoPE; an image's tokens take their grid coordinates instead (multimodal/mrope.py).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE over [3, T] positions (temporal, height, width), or [T] positions taken as
    equal in all three. `mrope_section` lists how many frequency pairs each of the three
    positions drives; they must add up to head_size / 2 (ValueError otherwise).
    `interleaved` picks Qwen3-VL's layout of the frequencies over the axes."""

    def __init__(
        self, head_size: int, max_position: int, params: dict[str, Any],
        mrope_section: list[int], interleaved: bool = False,
    ) -> None:
        super().__init__(head_size, max_position, params)
        if len(mrope_section) != 3 or sum(mrope_section) != head_size // 2:
            raise ValueError(
                f"rope_parameters.mrope_section: {mrope_section} must be three sizes adding "
                f"up to head_dim / 2 ({head_size // 2})"
            )
        # Which of the three positions each frequency follows.
        if interleaved:
            j = torch.arange(head_size // 2)
            axis = torch.zeros_like(j)
            axis[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
            axis[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
        else:
            axis = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        self.register_buffer("freq_axis", axis, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates query [T, H * D] and key [T, Hkv * D] by positions [3, T] (or [T]);
        returns new tensors."""
        if positions.dim() == 1:
            return super().forward(positions, query, key)
        freq = torch.arange(self.freq_axis.numel(), device=positions.device)
        # [3, T, D/2] tables, then per frequency the row of its own axis: [T, D/2].
        cos = self.cos_cache[positions].permute(1, 2, 0)[:, freq, self.freq_axis]
        sin = self.sin_cache[positions].permute(1, 2, 0)[:, freq, self.freq_axis]
        cos = cos.to(query.dtype).unsqueeze(1)
        sin = sin.to(query.dtype).unsqueeze(1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)
