"""mm_processor_kwargs: overrides of the image processor's settings, from the server
(--mm-processor-kwargs) or one request (the `mm_processor_kwargs` field of chat and
Responses requests, or of an offline dict prompt); a request's keys win over the server's.

Honoured: the pixel bounds an image is resized into, as transformers' Qwen2-VL processor
names them: `min_pixels` and `max_pixels`, or `size` with `shortest_edge` and
`longest_edge` (pixel counts despite the names). Any other key is refused naming it.
"""

from __future__ import annotations

import dataclasses
from vllm.exceptions import InvalidRequestError
from vllm.multimodal.qwen_vl_image import QwenVLImageConfig

# `size`'s keys and the bound each sets.
_SIZE_KEYS = {"shortest_edge": "min_pixels", "longest_edge": "max_pixels"}
SUPPORTED_KEYS = ("min_pixels", "max_pixels", "size")


def _pixels(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequestError(name, f"must be a positive integer (pixels), got {value!r}")
    return value


def check_processor_kwargs(kwargs: object, where: str) -> dict[str, int]:
    """`kwargs` as QwenVLImageConfig overrides ({"min_pixels": n, "max_pixels": m}, either
    may be absent). `where` is how the caller named the object (--mm-processor-kwargs,
    mm_processor_kwargs). Raises InvalidRequestError naming `where`.KEY for a key that is
    not supported, a bound that is not a positive integer, and a bound given twice
    (min_pixels and size.shortest_edge); crossed bounds are apply_processor_kwargs's."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidRequestError(where, 'must be an object such as {"max_pixels": 1003520}, '
                                  f"got {kwargs!r}")
    out: dict[str, int] = {}

    def put(field: str, value: object, name: str) -> None:
        if field in out:
            raise InvalidRequestError(name, f"sets {field} a second time (give min_pixels/"
                                      "max_pixels or size, not both)")
        out[field] = _pixels(value, name)

    for key, value in kwargs.items():
        name = f"{where}.{key}"
        if key in ("min_pixels", "max_pixels"):
            put(key, value, name)
        elif key == "size":
            if not isinstance(value, dict):
                raise InvalidRequestError(name, "must be an object with shortest_edge and/or "
                                          "longest_edge (pixel counts)")
            for sub, bound in value.items():
                field = _SIZE_KEYS.get(sub)
                if field is None:
                    raise InvalidRequestError(f"{name}.{sub}", "is not supported (only "
                                              "shortest_edge and longest_edge, in pixels)")
                put(field, bound, f"{name}.{sub}")
        else:
            raise InvalidRequestError(name, "is not supported here (only "
                                      f"{', '.join(SUPPORTED_KEYS)}: the image pixel bounds)")
    return out


def apply_processor_kwargs(config: QwenVLImageConfig, overrides: dict[str, int],
                           where: str) -> QwenVLImageConfig:
    """`config` with `overrides` (from check_processor_kwargs) laid over it. Raises
    InvalidRequestError naming `where`.min_pixels when the bounds then cross (a request's
    min_pixels over the server's max_pixels, say)."""
    if not overrides:
        return config
    merged = dataclasses.replace(config, **overrides)
    if merged.min_pixels > merged.max_pixels:
        raise InvalidRequestError(f"{where}.min_pixels" if "min_pixels" in overrides
                                  else f"{where}.max_pixels",
                                  f"min_pixels {merged.min_pixels} would be over max_pixels "
                                  f"{merged.max_pixels}")
    return merged

