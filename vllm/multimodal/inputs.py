"""What a request carries per image from the front end to the model runner."""

from __future__ import annotations

import msgspec
import numpy as np


class ImageFeature(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """One preprocessed image of a prompt and where its placeholder run lies.

    The pixels travel as float32 bytes (msgpack carries them as one binary field); the
    runner rebuilds the array with `pixels()`. `content_hash` is a digest of the pixels
    and grid: equal images share encoder outputs and prefix-cache blocks, different ones
    never do.
    """

    # First prompt position of the image's placeholder run and its length (tokens).
    offset: int
    length: int
    # (t, h, w) in patches.
    grid_thw: tuple[int, int, int]
    # [num_patches, patch_dim] float32, C order.
    pixel_bytes: bytes
    patch_dim: int
    content_hash: str

    def pixels(self) -> np.ndarray:
        """The patches as a read-only [num_patches, patch_dim] float32 array."""
        return np.frombuffer(self.pixel_bytes, dtype=np.float32).reshape(-1, self.patch_dim)

    @property
    def end(self) -> int:
        """The prompt position just past the placeholder run."""
        return self.offset + self.length
