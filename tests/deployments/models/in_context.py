"""What the in-context edit families' tests (FLUX.1 Kontext, Qwen-Image-Edit) share: a test image of varied
pixels (an edit of it differs from an edit of another) with an optional EXIF orientation, and one request
through a step batch of one, as the Denoiser runs a lone request (the conformance suite steps with it too)."""
from __future__ import annotations

import io

import torch
from PIL import Image

from deployments.replica.batching import BatchingConfig, StepBatch


def a_photo(width: int, height: int, orientation: int | None = None) -> bytes:
    image = Image.new("RGB", (width, height))
    image.putdata([(9 * x % 256, 5 * y % 256, 60) for y in range(height) for x in range(width)])
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    out = io.BytesIO()
    image.save(out, format="PNG", exif=exif)
    return out.getvalue()


def through_a_step_batch(stepper, request) -> torch.Tensor:
    """``request``'s final latents, stepped by a StepBatch of one."""
    batch = StepBatch(stepper, BatchingConfig(max_batch=1))
    future = batch.submit(request)
    while not batch.idle:
        batch.step()
    return future.result()
