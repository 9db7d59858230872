"""Reference images are checked before anything decodes them in full: type, bytes, declared pixels."""
from __future__ import annotations

import base64
import io
import random
import struct
import zlib

import pytest
from PIL import Image

from deployments.api.reference_images import (
    MAX_REFERENCE_BYTES,
    ReferenceImageError,
    check_reference_image,
    from_data_url,
)


def _image(fmt: str = "PNG", size=(16, 12)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(out, format=fmt)
    return out.getvalue()


def _noisy_png() -> bytes:
    out = io.BytesIO()
    Image.frombytes("RGB", (64, 64), random.Random(0).randbytes(64 * 64 * 3)).save(out, format="PNG")  # ~12 KB
    return out.getvalue()


def _bomb(width: int, height: int) -> bytes:
    """A valid PNG header declaring width x height, with a few bytes of data: a decompression bomb's shape."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_png_jpeg_and_webp_pass_unchanged(fmt):
    data = _image(fmt)
    assert check_reference_image(data) is data


@pytest.mark.parametrize("data, why", [
    (b"", "is empty"),
    (b"GIF89a not really", "is not an image"),
    (b"hello, a text file", "is not an image"),
    (_image("GIF"), "is a GIF image"),
    (_noisy_png()[:2000], "could not be decoded"),  # a truncated PNG: the header reads, the pixels do not
    (_bomb(5_000, 5_000), "decompression bomb"),  # 25 megapixels declared in ~100 bytes (Pillow warns at 89)
    (b"\x89PNG" + b"\0" * MAX_REFERENCE_BYTES, "exceeds the limit"),
])
def test_what_is_not_a_reference_image_is_refused_saying_why(data, why):
    with pytest.raises(ReferenceImageError, match=why):
        check_reference_image(data)


def test_a_data_url_is_decoded_and_checked():
    data = _image()
    assert from_data_url("data:image/png;base64," + base64.b64encode(data).decode()) == data
    for bad, why in [("http://example.com/a.png", "must be a data URL"), ("data:image/png;base64,@@@", "data URL"),
                     ("data:text/plain;base64,aGk=", "must be a data URL"),
                     ("data:image/png;base64," + base64.b64encode(b"text").decode(), "is not an image")]:
        with pytest.raises(ReferenceImageError, match=why):
            from_data_url(bad)
