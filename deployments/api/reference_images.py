"""Reference images (``input_reference``), checked before anything decodes them in full.

A multipart file (OpenAI's Videos API) or a data URL in JSON. The bytes are bounded first, then
Pillow reads only the header for the format and the pixel count, so a decompression bomb (a small
file declaring a huge canvas) is refused before one pixel is decoded; then the image is decoded
once here, so a truncated or corrupt file is a 400 at the ingress, never a 500 in a stage.
Run by the ingress (no FastAPI, no Ray).
"""
from __future__ import annotations

import base64
import binascii
import io
import re
import warnings

from PIL import Image, UnidentifiedImageError

# A reference frame is at most the output size (1024x1024 by default); 8 MiB holds a 16-megapixel
# JPEG or an ordinary PNG of 1080p, and bounds what one request may make the ingress hold.
MAX_REFERENCE_BYTES = 8 * 2**20
# 4096 x 4096: four times the largest default output side squared; Pillow's own bomb guard starts
# at 89 megapixels, so a 16-megapixel cap keeps a decoded frame under 64 MiB (RGBA).
MAX_REFERENCE_PIXELS = 4096 * 4096
FORMATS = ("PNG", "JPEG", "WEBP")
DATA_URL = re.compile(r"data:image/(png|jpeg|jpg|webp);base64,([A-Za-z0-9+/=\s]+)", re.ASCII)


class ReferenceImageError(ValueError):
    """The reference image is not one this server takes; the message says why, with the numbers."""


def check_reference_image(data: bytes) -> bytes:
    """``data`` if it is a PNG, JPEG or WebP image within the byte and pixel caps that decodes whole."""
    if not data:
        raise ReferenceImageError("is empty")
    if len(data) > MAX_REFERENCE_BYTES:
        raise ReferenceImageError(f"{len(data)} B exceeds the limit of {MAX_REFERENCE_BYTES} B")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:  # reads the header only
                kind, (width, height) = image.format, image.size
                if kind not in FORMATS:
                    raise ReferenceImageError(f"is a {kind} image; send {', '.join(FORMATS)}")
                if width * height > MAX_REFERENCE_PIXELS:
                    raise ReferenceImageError(f"declares {width}x{height} = {width * height} pixels, more than the "
                                              f"limit of {MAX_REFERENCE_PIXELS} (a decompression bomb is refused "
                                              "before decoding)")
                image.load()  # the one full decode: a truncated file fails here, not in a stage
    except ReferenceImageError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ReferenceImageError(f"is not an image this server reads ({', '.join(FORMATS)}): {exc}") from None
    except (OSError, ValueError, SyntaxError) as exc:  # Pillow's truncated/corrupt-file errors
        raise ReferenceImageError(f"could not be decoded: {exc}") from None
    return data


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) of an image :func:`check_reference_image` passed, from its header, as it will be
    given to the pipeline (its EXIF orientation applied: a portrait photo stored landscape is portrait)."""
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        orientation = image.getexif().get(0x0112, 1)  # 5-8: stored rotated by 90 or 270 degrees
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


def has_alpha(data: bytes) -> bool:
    """Whether an image :func:`check_reference_image` passed carries transparency (an alpha channel, or a
    PNG's transparency chunk): an OpenAI edit mask marks where to edit by it."""
    with Image.open(io.BytesIO(data)) as image:
        return image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info


def from_data_url(text: str) -> bytes:
    """The checked image of a ``data:image/<png|jpeg|webp>;base64,...`` URL."""
    match = DATA_URL.fullmatch(text.strip())
    if match is None:
        raise ReferenceImageError("must be a data URL 'data:image/png;base64,...' (png, jpeg or webp) in JSON, "
                                  "or a file in multipart/form-data")
    try:
        data = base64.b64decode("".join(match.group(2).split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ReferenceImageError(f"the data URL's base64 is invalid: {exc}") from None
    return check_reference_image(data)
