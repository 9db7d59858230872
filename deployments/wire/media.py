"""Frames (float32 in [0, 1], the pipelines' ``output_type="np"``) to image (PNG, JPEG, WebP) and MP4 bytes,
and an MP4's frames back (a video edit's source).

Images through Pillow, MP4 (H.264) through imageio with its bundled ffmpeg (imageio-ffmpeg). Encoding runs in
the process that answers the request or runs the video job (an ingress replica), on a worker thread;
decoding in the decoder stage replica, which encodes a video edit's source (deployments/models/edits.py).
"""
from __future__ import annotations

import enum
import io
import logging
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

# Set, it makes imageio-ffmpeg start ffmpeg without a preexec_fn, so CPython vfork()s: a fork() in a Ray
# replica runs gRPC's fork handlers mid-flight, which can abort the child before it becomes ffmpeg.
FFMPEG_NO_PREEXEC_ENV = "IMAGEIO_FFMPEG_NO_PREVENT_SIGINT"
# The top-level boxes every H.264 mp4 that ffmpeg finished has (ftyp header, moov index, mdat frames).
MP4_BOXES = frozenset({"ftyp", "moov", "mdat"})


class _AskedScale(logging.Filter):
    """imageio-ffmpeg warns at every read whose frame size differs from the video's: here that is always the
    edit's size, asked for (one WARNING per upload and per decode otherwise)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is different from the source frame size" not in record.getMessage()


logging.getLogger("imageio_ffmpeg").addFilter(_AskedScale())


class ImageFormat(str, enum.Enum):
    """An image's encoding: OpenAI's ``output_format`` values."""

    PNG = "png"
    JPEG = "jpeg"
    WEBP = "webp"

    @property
    def lossy(self) -> bool:
        return self is not ImageFormat.PNG


class VideoDecodeError(ValueError):
    """An edit's source video holds fewer frames than the edit asks for, or is not a video ffmpeg reads."""


class VideoEncodeError(RuntimeError):
    """The encoder's output is not a whole mp4 (ffmpeg died, or stopped early); names what is missing."""


def to_uint8(frames: torch.Tensor | np.ndarray) -> np.ndarray:
    """Float frames in [0, 1] as 8-bit pixels; 8-bit pixels (a decoded video's) as they are."""
    if isinstance(frames, np.ndarray) and frames.dtype == np.uint8:
        return frames
    # The same rounding as diffusers' numpy_to_pil, so PNGs match the pipeline's PIL output.
    return (frames.numpy() * 255).round().astype("uint8")


def png_bytes(image: torch.Tensor) -> bytes:
    """One image (H, W, 3) as PNG."""
    return image_bytes(image, ImageFormat.PNG)


def image_bytes(image: torch.Tensor, fmt: ImageFormat, compression: int | None = None) -> bytes:
    """One image (H, W, 3) as ``fmt``. ``compression`` (JPEG and WebP only): 0-100, OpenAI's
    ``output_compression``, where 100 keeps the most (Pillow's ``quality``); None: 100, as OpenAI."""
    from PIL import Image

    if compression is not None and not fmt.lossy:
        raise ValueError(f"compression applies to jpeg and webp, not {fmt.value}")
    buffer = io.BytesIO()
    options = {} if not fmt.lossy else {"quality": 100 if compression is None else compression}
    Image.fromarray(to_uint8(image)).save(buffer, format=fmt.value.upper(), **options)
    return buffer.getvalue()


# A spritesheet (OpenAI's ``variant=spritesheet``): up to 16 frames spread over the video, each at most 256 px
# on its longer side, in a grid as square as the count allows (4 x 4 at 16), as one JPEG.
SPRITESHEET_TILES = 16
SPRITESHEET_TILE_SIDE = 256


def spritesheet_bytes(video: torch.Tensor) -> bytes:
    """Frames spread evenly from the first to the last of ``video`` (frames, H, W, 3), tiled row by row, JPEG."""
    from PIL import Image

    count = min(SPRITESHEET_TILES, video.shape[0])
    picks = [round(i * (video.shape[0] - 1) / max(1, count - 1)) for i in range(count)]
    height, width = video.shape[1:3]
    shrink = min(1.0, SPRITESHEET_TILE_SIDE / max(height, width))
    tile = (max(1, round(width * shrink)), max(1, round(height * shrink)))
    columns = math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    sheet = Image.new("RGB", (columns * tile[0], rows * tile[1]))
    for i, frame in enumerate(picks):
        image = Image.fromarray(to_uint8(video[frame])).resize(tile, Image.Resampling.BILINEAR)
        sheet.paste(image, ((i % columns) * tile[0], (i // columns) * tile[1]))
    buffer = io.BytesIO()
    sheet.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def mp4_bytes(video: torch.Tensor, fps: int) -> bytes:
    """One video (frames, H, W, 3) as H.264 MP4 (yuv420p, so any player decodes it)."""
    import imageio.v3 as iio

    os.environ[FFMPEG_NO_PREEXEC_ENV] = "1"  # read by imageio-ffmpeg at each start
    # macro_block_size=1: sizes are already multiples of the model's factor (>= 2 as yuv420p needs).
    data = iio.imwrite("<bytes>", to_uint8(video), extension=".mp4", fps=fps, codec="libx264",
                       macro_block_size=1, plugin="FFMPEG")
    check_mp4(data)  # imageio-ffmpeg does not read ffmpeg's exit status
    return data


@dataclass(frozen=True)
class VideoProbe:
    """What ffmpeg reads from a video's header, before any frame is decoded."""

    width: int
    height: int
    fps: float
    codec: str


def video_probe(data: bytes) -> VideoProbe:
    """The header of the video in ``data`` (ffmpeg, in its own process), or :class:`VideoDecodeError`."""
    import imageio.v3 as iio

    os.environ[FFMPEG_NO_PREEXEC_ENV] = "1"
    try:
        meta = iio.immeta(data, extension=".mp4", plugin="FFMPEG")
        width, height = meta["size"]
        return VideoProbe(int(width), int(height), float(meta["fps"]), str(meta.get("codec", "")))
    except (OSError, RuntimeError, KeyError, TypeError, ValueError) as exc:
        raise VideoDecodeError(f"ffmpeg reads no video header in it ({type(exc).__name__})") from None


def _frames(data: bytes, most: int, size: tuple[int, int] | None, within_s: float | None = None):
    """Up to ``most`` frames of ``data``, each (H, W, 3) uint8, scaled by ffmpeg to ``size`` (width, height);
    ``within_s``: a :class:`VideoDecodeError` once decoding has taken longer (ffmpeg is stopped with the
    generator)."""
    import imageio.v3 as iio

    os.environ[FFMPEG_NO_PREEXEC_ENV] = "1"  # the decoder stage is a Ray replica too (see mp4_bytes)
    options = {} if size is None else {"size": size}
    deadline = None if within_s is None else time.monotonic() + within_s
    try:
        for index, frame in enumerate(iio.imiter(data, extension=".mp4", plugin="FFMPEG", **options)):
            if index == most:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise VideoDecodeError(f"took more than {within_s:g} s to decode {index} frames")
            yield frame
    except (OSError, RuntimeError) as exc:  # ffmpeg could not read it at all
        raise VideoDecodeError(f"the video of {len(data)} B does not decode: {str(exc).splitlines()[0]}") from None


def video_frames(data: bytes, count: int, size: tuple[int, int] | None = None) -> np.ndarray:
    """The first ``count`` frames of a video as (count, H, W, 3) uint8, decoded (and scaled to ``size``,
    width by height) by ffmpeg: the same bytes decode to the same pixels, so a video edit and its reference
    start from one video."""
    frames = list(_frames(data, count, size))
    if len(frames) < count:
        raise VideoDecodeError(f"the video of {len(data)} B has {len(frames)} frames, {count} asked for")
    return np.stack(frames)


def count_frames(data: bytes, most: int, size: tuple[int, int], within_s: float | None = None) -> int:
    """How many frames decode (at most ``most``), each scaled to ``size``: one frame held at a time."""
    return sum(1 for _ in _frames(data, most, size, within_s))


def last_frame(data: bytes, most: int, size: tuple[int, int],
               within_s: float | None = None) -> tuple[int, np.ndarray | None]:
    """(how many frames decode, at most ``most``; the last of them, (H, W, 3) uint8, or None if none does),
    each scaled to ``size``: one frame held at a time."""
    count, last = 0, None
    for count, last in enumerate(_frames(data, most, size, within_s), start=1):
        pass
    return count, last


def check_mp4(data: bytes) -> None:
    """Raise VideoEncodeError unless ``data`` is whole top-level mp4 boxes holding ftyp, moov and mdat."""
    boxes, at = [], 0
    while at < len(data):
        if at + 8 > len(data):
            raise VideoEncodeError(f"mp4 of {len(data)} B ends inside a box header at byte {at}")
        size, kind = int.from_bytes(data[at:at + 4], "big"), data[at + 4:at + 8].decode("latin-1")
        if size == 1:  # a 64-bit size follows the type
            size = int.from_bytes(data[at + 8:at + 16], "big")
        elif size == 0:  # the box runs to the end
            size = len(data) - at
        if size < 8 or at + size > len(data):
            raise VideoEncodeError(f"mp4 of {len(data)} B: box {kind!r} at byte {at} claims {size} B")
        boxes.append(kind)
        at += size
    missing = sorted(MP4_BOXES - set(boxes))
    if missing:
        raise VideoEncodeError(f"mp4 of {len(data)} B has no {', '.join(missing)} box (boxes: {boxes[:8]})")
