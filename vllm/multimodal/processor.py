"""Front-end processing of a prompt's images: checks, preprocessing, placeholder expansion.

A prompt names where each image goes with the model's image token (Qwen-VL:
`<|vision_start|><|image_pad|><|vision_end|>`, one `<|image_pad|>` per image). Each run of
image tokens is one image; a run of one token is expanded to the image's placeholder count
(what transformers' processor does to the text), and a run that already has that count is
kept. Every failure is an InvalidRequestError naming the image as the client sent it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from PIL import Image

from vllm.config.multimodal import MultiModalConfig, is_vl_config_flat
from vllm.exceptions import InvalidRequestError
from vllm.multimodal.inputs import ImageFeature
from vllm.multimodal.processor_kwargs import apply_processor_kwargs, check_processor_kwargs
from vllm.multimodal.qwen_vl_image import QwenVLImageConfig, num_image_tokens, preprocess

# Most pixels an image may have before it is resized (a 64-megapixel photo passes; a
# decompression bomb does not).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
# The text a chat message's image part becomes in the rendered prompt (Qwen-VL's).
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def content_hash(patches: bytes, grid_thw: tuple[int, int, int]) -> str:
    """A digest of an image as the model sees it (its patches and grid)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(tuple(grid_thw)).encode())
    digest.update(patches)
    return digest.hexdigest()


def image_runs(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `image_token_id` in `token_ids`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(token_ids):
        if t != image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class MultiModalProcessor:
    """Turns (prompt token ids, images) into expanded token ids and ImageFeatures for one
    model; `None` from `for_model` when the model takes no images."""

    def __init__(self, model_config: Any, mm_config: MultiModalConfig) -> None:
        hf = model_config.hf_config
        self.image_token_id: int = hf.image_token_id
        self.image_config = apply_processor_kwargs(
            QwenVLImageConfig.from_dir(model_config.model_dir, hf.vision_config),
            mm_config.mm_processor_kwargs or {}, "--mm-processor-kwargs")
        self.max_images = mm_config.limit("image")

    @classmethod
    def for_model(cls, model_config: Any, mm_config: MultiModalConfig
                  ) -> MultiModalProcessor | None:
        """The processor of a vision-language model, None for a text-only one."""
        if not is_vl_config_flat(model_config.hf_config):
            return None
        return cls(model_config, mm_config)

    def image_config_for(self, kwargs: object,
                         field: str = "mm_processor_kwargs") -> QwenVLImageConfig:
        """The settings one prompt's images are processed with: the server's, under the
        prompt's `kwargs` (its mm_processor_kwargs, None for none). Raises
        InvalidRequestError naming `field`.KEY for kwargs that are refused."""
        return apply_processor_kwargs(self.image_config, check_processor_kwargs(kwargs, field),
                                      field)

    def process(
        self, token_ids: list[int], images: Sequence[object], names: Sequence[str],
        prompt_field: str = "prompt", image_config: QwenVLImageConfig | None = None,
    ) -> tuple[list[int], list[ImageFeature]]:
        """(expanded token ids, one ImageFeature per image). `names` says how the client
        named each image (messages[0].content[1], multi_modal_data.image[0]); errors name
        it, or `prompt_field` for placeholders that do not match the images. The images
        are processed with `image_config` (default: the server's). Raises
        InvalidRequestError for too many images, an image that is not a PIL image, too
        large or of an unusable shape, and for placeholder runs that do not match."""
        config = image_config or self.image_config
        if len(images) > self.max_images:
            raise InvalidRequestError(
                names[self.max_images] if len(names) > self.max_images else prompt_field,
                f"{len(images)} images in one prompt; at most {self.max_images} are allowed "
                "(--limit-mm-per-prompt)",
            )
        runs = image_runs(token_ids, self.image_token_id)
        if len(runs) != len(images):
            raise InvalidRequestError(
                prompt_field,
                f"has {len(runs)} image placeholders ({IMAGE_PLACEHOLDER}) but "
                f"{len(images)} images were given",
            )
        out: list[int] = []
        features: list[ImageFeature] = []
        done = 0
        for (start, run), image, name in zip(runs, images, names, strict=True):
            patches, grid = self._preprocess(image, name, config)
            count = num_image_tokens(grid, config)
            if run not in (1, count):
                raise InvalidRequestError(
                    prompt_field, f"an image placeholder run of {run} tokens fits neither one "
                    f"token nor the {count} tokens of {name}")
            out.extend(token_ids[done:start])
            data = patches.tobytes()
            features.append(ImageFeature(
                offset=len(out), length=count, grid_thw=grid, pixel_bytes=data,
                patch_dim=patches.shape[1], content_hash=content_hash(data, grid)))
            out.extend([self.image_token_id] * count)
            done = start + run
        out.extend(token_ids[done:])
        return out, features

    def _preprocess(self, image: object, name: str, config: QwenVLImageConfig):
        if not isinstance(image, Image.Image):
            raise InvalidRequestError(name, f"must be a PIL image, got {type(image).__name__}")
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise InvalidRequestError(
                name, f"image of {image.width}x{image.height} pixels is over the limit of "
                f"{MAX_IMAGE_PIXELS} pixels")
        if image.width < 1 or image.height < 1:
            raise InvalidRequestError(name, "image is empty")
        try:
            return preprocess(image, config)
        except ValueError as e:
            raise InvalidRequestError(name, str(e)) from None
        except OSError as e:  # truncated or corrupt image data, found while decoding
            raise InvalidRequestError(name, f"cannot decode the image: {e}") from None


def prompt_images(prompt: object) -> tuple[list[object], list[str]]:
    """The images of a dict prompt's `multi_modal_data` ({"image": image or list}) and the
    name of each for error messages (the server passes its own under "_image_names").
    Raises InvalidRequestError for another shape or modality (a dict prompt's
    mm_processor_kwargs are read by MultiModalProcessor.image_config_for)."""
    if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
        return [], []
    data = prompt["multi_modal_data"]
    if not isinstance(data, dict):
        raise InvalidRequestError("multi_modal_data", "must be a dict such as {'image': image}")
    unknown = sorted(set(data) - {"image"})
    if unknown:
        raise InvalidRequestError(f"multi_modal_data.{unknown[0]}",
                                  "is not supported (only 'image')")
    images = data.get("image")
    if images is None:
        return [], []
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    names = prompt.get("_image_names") or [f"multi_modal_data.image[{i}]"
                                           for i in range(len(images))]
    return images, list(names)
