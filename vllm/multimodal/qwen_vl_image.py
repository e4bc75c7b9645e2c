"""Qwen2-VL / Qwen2.5-VL image preprocessing: resize to a multiple of the merge square,
rescale and normalize, cut into patches in the vision tower's order.

The settings come from the model directory's preprocessor_config.json (the file
transformers' image processor writes and reads), so an image becomes the same patches here
as in transformers' PIL image processor for that model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

# Pillow's resampling filters by the numbers preprocessor configs use.
_RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS,
             2: Image.Resampling.BILINEAR, 3: Image.Resampling.BICUBIC,
             4: Image.Resampling.BOX, 5: Image.Resampling.HAMMING}
# CLIP's statistics, the processor's defaults.
_MEAN = (0.48145466, 0.4578275, 0.40821073)
_STD = (0.26862954, 0.26130258, 0.27577711)
# An image whose long side is over this many times its short side is refused (the
# processor's own rule: the resize could not keep both sides a whole number of squares).
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class QwenVLImageConfig:
    """The preprocessing settings of one model."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, float, float] = _MEAN
    std: tuple[float, float, float] = _STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = 3

    @classmethod
    def from_dir(cls, model_dir: Path, vision_config: Any) -> QwenVLImageConfig:
        """Reads model_dir/preprocessor_config.json; without one, the processor's defaults
        with the vision config's patch, merge and temporal sizes. Raises ValueError for a
        malformed file."""
        path = Path(model_dir) / "preprocessor_config.json"
        raw: dict[str, Any] = {}
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except ValueError as e:
                raise ValueError(f"model: malformed preprocessor_config.json: {e}") from None
        size = raw.get("size") or {}
        fields: dict[str, Any] = {
            "patch_size": raw.get("patch_size", vision_config.patch_size),
            "merge_size": raw.get("merge_size", vision_config.spatial_merge_size),
            "temporal_patch_size": raw.get("temporal_patch_size",
                                           vision_config.temporal_patch_size),
        }
        # Older files name the pixel bounds min_pixels/max_pixels, newer ones size's
        # shortest_edge/longest_edge (in pixels, despite the names).
        low = raw.get("min_pixels") or size.get("min_pixels") or size.get("shortest_edge")
        high = raw.get("max_pixels") or size.get("max_pixels") or size.get("longest_edge")
        if low:
            fields["min_pixels"] = int(low)
        if high:
            fields["max_pixels"] = int(high)
        for key, name in (("image_mean", "mean"), ("image_std", "std")):
            if raw.get(key) is not None:
                fields[name] = tuple(float(v) for v in raw[key])
        for key in ("rescale_factor", "do_resize", "do_rescale", "do_normalize", "resample"):
            if raw.get(key) is not None:
                fields[key] = raw[key]
        return cls(**fields)

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this (one merge square)."""
        return self.patch_size * self.merge_size


def fit_size(height: int, width: int, config: QwenVLImageConfig) -> tuple[int, int]:
    """The (height, width) an image is resized to: multiples of `config.factor`, about
    the same aspect ratio, within [min_pixels, max_pixels] pixels. Raises ValueError for
    an aspect ratio over MAX_ASPECT_RATIO."""
    if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
        raise ValueError(f"aspect ratio {max(height, width)}:{min(height, width)} is over "
                         f"{MAX_ASPECT_RATIO}:1")
    f = config.factor
    h = round(height / f) * f
    w = round(width / f) * f
    if h * w > config.max_pixels:
        scale = math.sqrt(height * width / config.max_pixels)
        h = max(f, math.floor(height / scale / f) * f)
        w = max(f, math.floor(width / scale / f) * f)
    elif h * w < max(config.min_pixels, 1):
        scale = math.sqrt(config.min_pixels / (height * width))
        h = math.ceil(height * scale / f) * f
        w = math.ceil(width * scale / f) * f
    return h, w


def to_rgb(image: Image.Image) -> Image.Image:
    """The image in RGB; transparency is laid over white."""
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def preprocess(image: Image.Image, config: QwenVLImageConfig) -> tuple[np.ndarray,
                                                                         tuple[int, int, int]]:
    """One image as vision-tower input: ([num_patches, patch_dim] float32 patches, grid
    (t, h, w) in patches). Raises ValueError for an unusable aspect ratio."""
    image = to_rgb(image)
    if config.do_resize:
        height, width = fit_size(image.height, image.width, config)
        if (height, width) != (image.height, image.width):
            image = image.resize((width, height), _RESAMPLE.get(config.resample,
                                                                Image.Resampling.BICUBIC))
    pixels = np.asarray(image).transpose(2, 0, 1)  # [C, H, W] uint8
    if config.do_rescale:
        pixels = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    else:
        pixels = pixels.astype(np.float32)
    if config.do_normalize:
        mean = np.asarray(config.mean, dtype=np.float32)[:, None, None]
        std = np.asarray(config.std, dtype=np.float32)[:, None, None]
        pixels = (pixels - mean) / std
    return patchify(pixels, config)


def patchify(pixels: np.ndarray, config: QwenVLImageConfig) -> tuple[np.ndarray,
                                                                       tuple[int, int, int]]:
    """Cuts a [C, H, W] image (sides multiples of the merge square) into patch rows:
    merge squares row-major, patches row-major inside each, every patch repeated
    temporal_patch_size times (a still image is a clip of equal frames)."""
    c, height, width = pixels.shape
    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    gh, gw = height // p, width // p
    x = pixels.reshape(c, gh // m, m, p, gw // m, m, p)
    # -> [squares down, squares across, m, m, C, p, p]
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p))
    patches = np.ascontiguousarray(x.reshape(gh * gw, c * tp * p * p), dtype=np.float32)
    return patches, (1, gh, gw)


def num_image_tokens(grid_thw: tuple[int, int, int], config: QwenVLImageConfig) -> int:
    """Placeholder tokens (language-model embeddings) of an image with this grid."""
    t, h, w = grid_thw
    return t * h * w // (config.merge_size ** 2)
