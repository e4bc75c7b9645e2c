"""Images named by URL in chat messages: data URLs, local files under
--allowed-local-media-path, and http(s) URLs of --allowed-media-domains, each read within a
size limit (and a time limit over the network) and decoded with checks.

Every refusal is an InvalidRequestError naming the content part (messages[i].content[j]).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from PIL import Image

from vllm.exceptions import InvalidRequestError
from vllm.multimodal.processor import MAX_IMAGE_PIXELS

# Most bytes one image may have, encoded (a data URL is also bounded by the request body).
MAX_IMAGE_BYTES = 32 * 1024 * 1024
# Upstream's variable for the time an http(s) image may take to arrive (seconds).
FETCH_TIMEOUT_ENV = "VLLM_IMAGE_FETCH_TIMEOUT"
DEFAULT_FETCH_TIMEOUT_S = 5.0
# Formats decoded here (Pillow's names).
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")


def decode_image(data: bytes, name: str) -> Image.Image:
    """Decodes an encoded image, fully, in RGB-compatible form. Raises InvalidRequestError
    naming `name` for data that is not an image of IMAGE_FORMATS, a corrupt or truncated
    one, or one over MAX_IMAGE_PIXELS (checked before its pixels are decoded)."""
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(name, f"image of {len(data)} bytes is over the limit of "
                                  f"{MAX_IMAGE_BYTES} bytes")
    try:
        # formats= restricts the decoders tried; the size is known before any pixel is.
        image = Image.open(io.BytesIO(data), formats=list(IMAGE_FORMATS))
    except Image.UnidentifiedImageError:
        raise InvalidRequestError(
            name, f"not an image in a supported format ({', '.join(IMAGE_FORMATS)})"
        ) from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise InvalidRequestError(name, f"cannot decode the image: {e}") from None
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise InvalidRequestError(name, f"image of {image.width}x{image.height} pixels is "
                                  f"over the limit of {MAX_IMAGE_PIXELS} pixels")
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise InvalidRequestError(name, f"cannot decode the image: {e}") from None
    return image


def _data_url(url: str, name: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:image/") or not header.endswith(";base64"):
        raise InvalidRequestError(name, "a data URL must be data:image/<format>;base64,<data>")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise InvalidRequestError(name, f"image is over the limit of {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(name, "the data URL's payload is not valid base64") from None


def _local_file(url: str, allowed: str | None, name: str) -> bytes:
    if not allowed:
        raise InvalidRequestError(name, "file:// URLs are not allowed (start the server with "
                                  "--allowed-local-media-path DIR)")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise InvalidRequestError(name, "a file:// URL must name a local path")
    root = Path(allowed).resolve()
    path = Path(urllib.parse.unquote(parsed.path)).resolve()
    if not path.is_relative_to(root):
        raise InvalidRequestError(name, "the file is outside --allowed-local-media-path")
    if not path.is_file():
        raise InvalidRequestError(name, "no such file")
    if path.stat().st_size > MAX_IMAGE_BYTES:
        raise InvalidRequestError(name, f"image is over the limit of {MAX_IMAGE_BYTES} bytes")
    return path.read_bytes()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect could lead off the allowed domains: it is refused, never followed."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        """Always None: urllib then raises the 3xx as an HTTPError."""
        return None


def _fetch(url: str, domains: list[str] | None, name: str) -> bytes:
    host = (urllib.parse.urlparse(url).hostname or "").lower()
    if not domains or host not in {d.lower() for d in domains}:
        raise InvalidRequestError(name, f"fetching images from {host or url!r} is not allowed "
                                  "(start the server with --allowed-media-domains HOST ...)")
    timeout = float(os.environ.get(FETCH_TIMEOUT_ENV) or DEFAULT_FETCH_TIMEOUT_S)
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(url, timeout=timeout) as response:
            data = response.read(MAX_IMAGE_BYTES + 1)
    except urllib.error.HTTPError as e:
        raise InvalidRequestError(name, f"fetching the image failed: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise InvalidRequestError(name, f"fetching the image failed: {e}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(name, f"image is over the limit of {MAX_IMAGE_BYTES} bytes")
    return data


def load_image_url(url: object, name: str, allowed_local_media_path: str | None = None,
                   allowed_media_domains: list[str] | None = None) -> Image.Image:
    """The image a chat content part's URL names, decoded (see decode_image). Raises
    InvalidRequestError naming `name` for another scheme, a URL the server's flags do not
    allow, or data that cannot be read or decoded."""
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(name, "image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        data = _data_url(url, name)
    elif scheme == "file":
        data = _local_file(url, allowed_local_media_path, name)
    elif scheme in ("http", "https"):
        data = _fetch(url, allowed_media_domains, name)
    else:
        raise InvalidRequestError(name, "image_url.url must be a data:, file: or http(s): URL")
    return decode_image(data, name)
