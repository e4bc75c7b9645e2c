"""M-RoPE positions of a prompt with images (Qwen2-VL's scheme).

Text tokens count up one position at a time, equal in all three components. An image's
placeholder tokens, laid out row-major over its grid of merge squares (lh x lw), take
(start + frame, start + row, start + column), where start is the position the image
begins at; the text after it resumes at start + max(lh, lw). A prompt therefore spans
fewer positions than tokens, and every token after the prompt (the outputs) sits at its
index plus `delta` (zero or negative).
"""

from __future__ import annotations

import numpy as np

from vllm.multimodal.inputs import ImageFeature


def mrope_positions(
    num_prompt_tokens: int, images: list[ImageFeature], merge_size: int
) -> tuple[np.ndarray, int]:
    """([3, num_prompt_tokens] int64 positions of the prompt, delta of later tokens).
    Raises ValueError when placeholder runs overlap or leave the prompt."""
    table = np.empty((3, num_prompt_tokens), dtype=np.int64)
    index = 0  # next prompt token to place
    position = 0  # next position value
    for image in sorted(images, key=lambda im: im.offset):
        if image.offset < index or image.end > num_prompt_tokens:
            raise ValueError(f"image placeholder run [{image.offset}, {image.end}) overlaps "
                             f"another or leaves the {num_prompt_tokens}-token prompt")
        text = image.offset - index
        table[:, index:image.offset] = position + np.arange(text)
        position += text
        t, h, w = image.grid_thw
        lh, lw = h // merge_size, w // merge_size
        if t * lh * lw != image.length:
            raise ValueError(f"image grid {image.grid_thw} has {t * lh * lw} merge squares "
                             f"but {image.length} placeholder tokens")
        frames, rows, cols = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw),
                                         indexing="ij")
        run = slice(image.offset, image.end)
        table[0, run] = position + frames.reshape(-1)
        table[1, run] = position + rows.reshape(-1)
        table[2, run] = position + cols.reshape(-1)
        position += max(lh, lw)
        index = image.end
    table[:, index:] = position + np.arange(num_prompt_tokens - index)
    position += num_prompt_tokens - index
    return table, position - num_prompt_tokens

