"""What a finished generation is answered with: its JSON body (or the mp4 itself) and, for
``"stream": true``, its closing Server-Sent Events.

Runs in the ingress replica's process, on a worker thread unless the output is a few small images
(:meth:`deployments.api.service.Service.render`). An image stream closes the way OpenAI's does, one
``image_generation.completed`` event per image with its ``b64_json`` (an edit's: ``image_edit.completed``),
so the official client's ``images.generate(..., stream=True)`` and ``images.edit(..., stream=True)`` hand
each image over as ``event.b64_json``; a video has no OpenAI stream and closes with one ``result`` event
holding the synchronous body.
"""
from __future__ import annotations

import base64
import enum
import time
from dataclasses import dataclass

from fastapi.responses import Response

from deployments.wire import media
from deployments.wire.media import ImageFormat
from deployments.wire.spec import GenerationSpec


class ImageStream(str, enum.Enum):
    """Whose event types an image stream uses: OpenAI names a generation's and an edit's apart (the
    official client parses each by them)."""

    GENERATION = "image_generation"
    EDIT = "image_edit"

    @property
    def completed(self) -> str:
        return f"{self.value}.completed"  # a streamed image

    @property
    def partial(self) -> str:
        return f"{self.value}.partial_image"  # a preview before it (partial_images)


@dataclass(frozen=True)
class Generated:
    spec: GenerationSpec
    frames: object  # torch.Tensor (n, frames, H, W, 3)
    stats: tuple  # tuple[StageStats, ...], in stage order


def stage_stats(generated: Generated) -> list[dict]:
    return [{"stage": s.stage, "replica": s.replica, "seconds": round(s.seconds, 4),
             "started_at": round(s.started_at, 6), "bytes_streamed": s.bytes_streamed,
             "device_peak_bytes": s.device_peak_bytes,
             **({"steps": s.steps, "cache_skips": s.cache_skips} if s.steps else {})}
            for s in generated.stats]


def envelope(generated: Generated, data: list[dict], **extra) -> dict:
    """The synchronous routes' body: OpenAI's ``created`` and ``data``, with the request id, the
    seed and what each stage cost."""
    return {"created": int(time.time()), "id": generated.spec.request_id, "seed": generated.spec.seed,
            **extra, "data": data, "stages": stage_stats(generated)}


@dataclass(frozen=True)
class ImageRendering:
    """Images as ``output_format`` (``compression``: JPEG's or WebP's quality, 0-100; None: 100)."""

    output_format: ImageFormat = ImageFormat.PNG
    compression: int | None = None
    stream: ImageStream = ImageStream.GENERATION

    def encoded(self, generated: Generated) -> list[str]:
        return [base64.b64encode(media.image_bytes(item[0], self.output_format, self.compression)).decode()
                for item in generated.frames]

    def _size(self, generated: Generated) -> str:
        return f"{generated.spec.width}x{generated.spec.height}"

    def body(self, generated: Generated) -> dict:
        return envelope(generated, [{"b64_json": image} for image in self.encoded(generated)],
                        size=self._size(generated), output_format=self.output_format.value)

    def _event(self, generated: Generated, index: int, image: str, **extra) -> dict:
        """An image event's data in OpenAI's shape (``background``: these images have no alpha), with
        this project's ``id`` and ``index`` (the image's place among the request's ``n``)."""
        return {"b64_json": image, "created_at": int(time.time()), "size": self._size(generated),
                "output_format": self.output_format.value, "background": "opaque",
                "id": generated.spec.request_id, "index": index, **extra}

    def events(self, generated: Generated) -> list[tuple[str, dict]]:
        """(event, data) to close a stream (the stream adds each data's ``type``: its event's name):
        one ``image_generation.completed`` (``image_edit.completed``) per image, with the ``seed`` and the
        ``stages``."""
        stats = stage_stats(generated)
        return [(self.stream.completed, self._event(generated, index, image, seed=generated.spec.seed, stages=stats))
                for index, image in enumerate(self.encoded(generated))]

    def partial_events(self, generated: Generated, partial_image_index: int, step: int) -> list[tuple[str, dict]]:
        """One ``image_generation.partial_image`` (``image_edit.partial_image``) per image: the preview
        decoded after ``step``."""
        return [(self.stream.partial, self._event(generated, index, image, partial_image_index=partial_image_index, step=step))
                for index, image in enumerate(self.encoded(generated))]


@dataclass(frozen=True)
class VideoRendering:
    """One video as H.264 at ``fps``: the mp4 itself (``as_mp4``) or JSON with it in base64."""

    fps: int
    as_mp4: bool = False

    def body(self, generated: Generated) -> Response | dict:
        video = media.mp4_bytes(generated.frames[0], self.fps)
        if self.as_mp4:
            return Response(video, media_type="video/mp4", headers={"X-Seed": str(generated.spec.seed)})
        return envelope(generated, [{"b64_json": base64.b64encode(video).decode(), "mime_type": "video/mp4",
                                     "frames": generated.spec.num_frames, "fps": self.fps}])

    def events(self, generated: Generated) -> list[tuple[str, dict]]:
        return [("result", self.body(generated))]


Rendering = ImageRendering | VideoRendering
