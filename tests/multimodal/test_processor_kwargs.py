"""mm_processor_kwargs: the pixel bounds are read (also as size's shortest_edge and
longest_edge) and laid over a model's settings; everything else is refused naming the key."""

from __future__ import annotations

import pytest

from vllm.exceptions import InvalidRequestError
from vllm.multimodal.processor_kwargs import apply_processor_kwargs, check_processor_kwargs
from vllm.multimodal.qwen_vl_image import QwenVLImageConfig


def test_bounds_are_read_and_laid_over_the_model_settings() -> None:
    base = QwenVLImageConfig(min_pixels=64, max_pixels=4096)
    assert check_processor_kwargs(None, "k") == {}
    both = check_processor_kwargs({"min_pixels": 256, "max_pixels": 1024}, "k")
    assert both == check_processor_kwargs(
        {"size": {"shortest_edge": 256, "longest_edge": 1024}}, "k")
    merged = apply_processor_kwargs(base, both, "k")
    assert (merged.min_pixels, merged.max_pixels) == (256, 1024)
    assert merged.patch_size == base.patch_size
    only_max = apply_processor_kwargs(base, check_processor_kwargs({"max_pixels": 100}, "k"),
                                      "k")
    assert (only_max.min_pixels, only_max.max_pixels) == (64, 100)


@pytest.mark.parametrize("kwargs, param, message", [
    ([1], "mm_processor_kwargs", "must be an object"),
    ({"fps": 2}, "mm_processor_kwargs.fps", "not supported"),
    ({"max_pixels": 0}, "mm_processor_kwargs.max_pixels", "positive integer"),
    ({"min_pixels": "64"}, "mm_processor_kwargs.min_pixels", "positive integer"),
    ({"min_pixels": True}, "mm_processor_kwargs.min_pixels", "positive integer"),
    ({"size": 5}, "mm_processor_kwargs.size", "must be an object"),
    ({"size": {"height": 5}}, "mm_processor_kwargs.size.height", "not supported"),
    ({"max_pixels": 9, "size": {"longest_edge": 9}}, "mm_processor_kwargs.size.longest_edge",
     "second time"),
    ({"min_pixels": 5000}, "mm_processor_kwargs.min_pixels", "over max_pixels 4096"),
    ({"max_pixels": 10}, "mm_processor_kwargs.max_pixels", "over max_pixels 10"),
])
def test_refused_naming_the_key(kwargs, param, message) -> None:
    base = QwenVLImageConfig(min_pixels=64, max_pixels=4096)
    with pytest.raises(InvalidRequestError) as e:
        apply_processor_kwargs(base, check_processor_kwargs(kwargs, "mm_processor_kwargs"),
                               "mm_processor_kwargs")
    assert e.value.param == param
    assert message in e.value.message
