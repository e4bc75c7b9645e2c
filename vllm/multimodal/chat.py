"""Chat messages whose content is a list of parts: text parts are joined, and each image
part becomes the model's image placeholder in the text and one image of the prompt.

Parts: {"type": "text", "text": str}, {"type": "image_url", "image_url": {"url": str,
"detail": "auto"}} (or the URL as a string), and, offline only, {"type": "image_pil",
"image_pil": PIL.Image}. Anything else is refused, naming messages[i].content[j].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from vllm.exceptions import InvalidRequestError
from vllm.multimodal.media import load_image_url


@dataclass
class ChatImages:
    """What flattening a conversation found: the messages with string content, and the
    images in prompt order with the part each came from."""

    messages: list[dict[str, Any]]
    images: list[Image.Image] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    def prompt(self, text: str, mm_processor_kwargs: dict[str, Any] | None = None
               ) -> str | dict[str, Any]:
        """The engine prompt of the rendered `text`: a dict with the images when there are
        any (their names go along for error messages) and the request's
        mm_processor_kwargs when given, else the text."""
        out: dict[str, Any] = {"prompt": text}
        if self.images:
            out.update({"multi_modal_data": {"image": self.images},
                        "_image_names": self.names})
        if mm_processor_kwargs is not None:
            out["mm_processor_kwargs"] = mm_processor_kwargs
        return out if len(out) > 1 else text


def _image_url(part: dict[str, Any], name: str) -> object:
    value = part.get("image_url")
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{name}.image_url", "must be an object with a 'url'")
    unknown = sorted(set(value) - {"url", "detail"})
    if unknown:
        raise InvalidRequestError(f"{name}.image_url.{unknown[0]}", "is not a known field")
    if value.get("detail", "auto") != "auto":
        raise InvalidRequestError(f"{name}.image_url.detail", "only 'auto' is supported (the "
                                  "model's processor sizes every image)")
    return value.get("url")


def flatten_messages(
    messages: list[Any], placeholder: str | None, model_name: str,
    allowed_local_media_path: str | None = None,
    allowed_media_domains: list[str] | None = None,
    message_names: list[str] | None = None,
) -> ChatImages:
    """The conversation with every list content made a string, its images loaded.

    `placeholder` is the text an image part becomes (None: the model takes no images, and
    an image part is refused naming `model_name`). `message_names` says how the client
    named each message (default messages[i]; /v1/responses names its input items). Raises
    InvalidRequestError naming the part for a part of an unknown type, a text part without
    text, and any image that cannot be loaded (media.py)."""
    out = ChatImages(messages=[])
    for i, message in enumerate(messages):
        where = message_names[i] if message_names is not None else f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(where, "must be an object")
        msg = dict(message)
        content = msg.get("content")
        if content is None:
            msg["content"] = ""
        elif isinstance(content, list):
            texts: list[str] = []
            for j, part in enumerate(content):
                name = f"{where}.content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise InvalidRequestError(name, "a text part needs a string 'text'")
                    texts.append(part["text"])
                    continue
                if kind not in ("image_url", "image_pil"):
                    raise InvalidRequestError(
                        name, f"content part type {kind!r} is not supported (text, "
                        "image_url)")
                if placeholder is None:
                    raise InvalidRequestError(
                        name, f"model {model_name!r} does not take images (it is not a "
                        "vision-language model)")
                if kind == "image_pil":
                    image = part.get("image_pil")
                    if not isinstance(image, Image.Image):
                        raise InvalidRequestError(name, "image_pil must be a PIL image")
                else:
                    image = load_image_url(_image_url(part, name), name,
                                           allowed_local_media_path, allowed_media_domains)
                out.images.append(image)
                out.names.append(name)
                texts.append(placeholder)
            msg["content"] = "".join(texts)
        out.messages.append(msg)
    return out
