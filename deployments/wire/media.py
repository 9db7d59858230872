"""Frames (float32 in [0, 1], the pipelines' ``output_type="np"``) to PNG and MP4 bytes.

PNG through Pillow, MP4 (H.264) through imageio with its bundled ffmpeg (imageio-ffmpeg).
"""
from __future__ import annotations

import io

import numpy as np
import torch


def to_uint8(frames: torch.Tensor) -> np.ndarray:
    # The same rounding as diffusers' numpy_to_pil, so PNGs match the pipeline's PIL output.
    return (frames.numpy() * 255).round().astype("uint8")


def png_bytes(image: torch.Tensor) -> bytes:
    """One image (H, W, 3) as PNG."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(to_uint8(image)).save(buffer, format="PNG")
    return buffer.getvalue()


def mp4_bytes(video: torch.Tensor, fps: int) -> bytes:
    """One video (frames, H, W, 3) as H.264 MP4 (yuv420p, so any player decodes it)."""
    import imageio.v3 as iio

    # macro_block_size=1: sizes are already multiples of the model's factor (>= 2 as yuv420p needs).
    return iio.imwrite("<bytes>", to_uint8(video), extension=".mp4", fps=fps, codec="libx264",
                       macro_block_size=1, plugin="FFMPEG")
