"""A reference image is the picture the user sees: turned upright by its EXIF orientation, as diffusers'
``load_image`` does before an image-to-video pipeline gets it (a phone stores a portrait photo landscape
with an orientation tag)."""
from __future__ import annotations

import io

from diffusers.utils import load_image
from PIL import Image

from deployments.models.adapter import reference_image
from deployments.wire.spec import GenerationSpec

ORIENTATION = 0x0112  # the EXIF tag; 6: rotate 90 degrees clockwise to display


def _tagged_jpeg(orientation: int) -> bytes:
    stored = Image.new("RGB", (32, 16), (220, 30, 30))
    stored.paste((30, 30, 220), (16, 0, 32, 16))  # left red, right blue: a rotation moves them
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    out = io.BytesIO()
    stored.save(out, format="JPEG", quality=95, exif=exif)
    return out.getvalue()


def test_a_reference_photo_is_turned_upright_by_its_exif_orientation_as_load_image_does():
    data = _tagged_jpeg(6)
    spec = GenerationSpec("r", "waves", None, 32, 16, 5, 2, 5.0, 0, 1, data)
    ours = reference_image(spec)
    theirs = load_image(Image.open(io.BytesIO(data)))
    assert ours.mode == "RGB" and ours.size == theirs.size == (16, 32)
    assert ours.tobytes() == theirs.tobytes()
    top, bottom = ours.getpixel((8, 4)), ours.getpixel((8, 28))
    assert top[0] > 150 > top[2] and bottom[2] > 150 > bottom[0], (top, bottom)  # red on top after the turn


def test_an_untagged_image_is_used_as_stored():
    data = _tagged_jpeg(1)
    ours = reference_image(GenerationSpec("r", "waves", None, 16, 32, 5, 2, 5.0, 0, 1, data))
    assert ours.size == (32, 16) and ours.tobytes() == Image.open(io.BytesIO(data)).convert("RGB").tobytes()
