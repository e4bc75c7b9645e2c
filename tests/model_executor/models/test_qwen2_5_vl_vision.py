"""The vision towers' refusals (Qwen2.5-VL's and Qwen3-VL's, which shares its pieces): an
activation the towers lack names vision_config.hidden_act, and an image grid that does not
divide into merge squares or does not match its patch rows is a ValueError."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.utils_vl import QWEN3_VISION, VISION
from vllm.model_executor.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer
from vllm.model_executor.models.qwen3_vl_vision import Qwen3VisionTransformer

TOWERS = {
    "qwen2_5_vl": (Qwen2_5_VisionTransformer, transformers.Qwen2_5_VLVisionConfig, VISION),
    "qwen3_vl": (Qwen3VisionTransformer, transformers.Qwen3VLVisionConfig, QWEN3_VISION),
}


def _tower(family: str, **overrides):
    tower, config, settings = TOWERS[family]
    return tower(config(**{**settings, **overrides}))


@pytest.mark.parametrize("family", TOWERS)
def test_unknown_activation_names_the_field(family) -> None:
    with pytest.raises(ValueError, match=r"^vision_config\.hidden_act: 'relu6' is not"):
        _tower(family, hidden_act="relu6")


PATCH = 3 * 2 * 4 * 4  # channels x temporal_patch_size x patch_size**2


@pytest.mark.parametrize("family", TOWERS)
def test_a_grid_of_whole_squares_merges_four_patches_to_a_row(family) -> None:
    out = _tower(family)(torch.randn(24, PATCH), (1, 4, 6))
    merged = out[0] if isinstance(out, tuple) else out  # Qwen3-VL adds DeepStack rows
    assert merged.shape == (6, 64)


@pytest.mark.parametrize("family", TOWERS)
@pytest.mark.parametrize("grid, rows", [((1, 3, 4), 12), ((1, 4, 4), 15)],
                         ids=["odd-height", "rows-short"])
def test_a_grid_off_the_squares_or_the_rows_is_refused(family, grid, rows) -> None:
    with pytest.raises(ValueError, match=r"^image grid \(1, \d, 4\) does not match its"):
        _tower(family)(torch.randn(rows, PATCH), grid)
