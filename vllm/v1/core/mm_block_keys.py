"""Prefix-cache keys of a prompt with images.

A block's hash covers its token ids, and every placeholder token of every image has the
same id, so two prompts that differ only in their images would share blocks. The scheduler
therefore hashes a keyed view of a multimodal request's tokens: each placeholder position
reads as a negative number derived from its image's content hash (token ids are never
negative). The same text with another image hashes apart from the first block that holds
an image token; the same image at the same place hashes alike and shares blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

from vllm.multimodal.inputs import ImageFeature


def image_key(feature: ImageFeature) -> int:
    """The stand-in of the image's placeholder tokens in block hashes (negative)."""
    return -1 - int(feature.content_hash[:15], 16)


class KeyedTokens(Sequence[int]):
    """A live view of a request's token ids (prompt and outputs, growing) in which the
    placeholder positions of its images read as their image keys."""

    def __init__(self, token_ids: list[int], images: list[ImageFeature]) -> None:
        self._tokens = token_ids
        self._keys = {p: image_key(f) for f in images for p in range(f.offset, f.end)}

    def __len__(self) -> int:
        return len(self._tokens)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        """The keyed token at `index`, or a list of them for a slice."""
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self._tokens))
            keys = self._keys
            return [keys.get(i, self._tokens[i]) for i in range(start, stop, step)]
        if index < 0:
            index += len(self._tokens)
        return self._keys.get(index, self._tokens[index])
