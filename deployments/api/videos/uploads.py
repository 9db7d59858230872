"""An uploaded video to edit (``POST /v1/videos/edits`` with ``video`` a file), checked before it is decoded in full.

The official client's ``videos.edit(prompt=..., video=open("clip.mp4", "rb"))`` posts the file. The bytes are
bounded first; then only ISO base-media files are taken (mp4, mov: whole top-level boxes with ``ftyp``,
``moov`` and ``mdat``), so ffmpeg's other demuxers never see request bytes; then ffmpeg (its own process, as
for every decode here) reads the header: the codec must be one of :data:`CODECS` and the frame at most
:data:`MAX_SOURCE_SIDE` a side. Only then does it decode, at most ``limits.max_frames`` frames, each scaled
to the edit's size as it is decoded, one frame held at a time: a truncated or corrupt file is a 400 here,
never a failed job. The decoder stage decodes the same bytes the same way (``deployments.models.edits``).

Run by the ingress replica, on a worker thread (the decode blocks).
"""
from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field

import numpy as np

from deployments.capacity.request_limits import FieldError, Limits, parse_size
from deployments.models.families import FamilyTraits
from deployments.wire import media

# A 5 s 1080p H.264 clip at a phone's bit rate (~20 Mbit/s) is ~12 MiB; 64 MiB bounds what one request
# may make the ingress hold.
MAX_SOURCE_VIDEO_BYTES = 64 * 2**20
# ffmpeg decodes the native frame before it scales it: 4096 a side holds 4K video and bounds that frame
# (50 MiB as RGB) inside ffmpeg's process.
MAX_SOURCE_SIDE = 4096
CODECS = frozenset({"h264", "hevc", "av1", "vp9", "mpeg4"})
# The check decodes on one of the ingress's worker threads: a file that decodes slower than this (81 frames of
# clean 1080p took 0.46 s here, of grainy 1080p 1.97 s: bench/video_sources.py) is refused, not waited for.
MAX_CHECK_S = 30.0


@dataclass(frozen=True)
class SourceShape:
    """What an uploaded video gives its edit: the size it is edited at, its frames there and its frame rate."""

    width: int
    height: int
    frames: int  # frames that decode, at most the most asked for
    fps: int  # the video's, rounded
    last: np.ndarray | None = dataclass_field(default=None, compare=False, repr=False)  # its last frame, if asked


def check_source_video(data: bytes, size: str | None, facts: FamilyTraits, limits: Limits,
                       most: int | None = None, whole: bool = False) -> SourceShape:
    """The upload's shape at ``size`` (None or ``auto``: its own, rounded down to the model's multiple), its
    frames counted up to ``most`` (None: ``limits.max_frames``), or a :class:`FieldError` naming ``video`` (or
    ``size``). ``whole``: the video must end within ``most`` frames (an extension goes on from its last,
    which :attr:`SourceShape.last` then holds)."""
    if not data:
        raise FieldError("video", "is empty")
    if len(data) > MAX_SOURCE_VIDEO_BYTES:
        raise FieldError("video", f"{len(data)} B exceeds the limit of {MAX_SOURCE_VIDEO_BYTES} B")
    try:
        media.check_mp4(data)
    except media.VideoEncodeError as exc:
        raise FieldError("video", f"is not an mp4 or mov file whole: {exc}") from None
    try:
        probe = media.video_probe(data)
    except media.VideoDecodeError as exc:
        raise FieldError("video", str(exc)) from None
    if probe.codec not in CODECS:
        raise FieldError("video", f"is {probe.codec or 'in no known codec'}; send {', '.join(sorted(CODECS))}")
    if max(probe.width, probe.height) > MAX_SOURCE_SIDE:
        raise FieldError("video", f"is {probe.width}x{probe.height}, more than {MAX_SOURCE_SIDE} a side")
    fps = round(probe.fps)
    if not 1 <= fps <= 60:
        raise FieldError("video", f"runs at {probe.fps:g} frames per second; send 1 to 60")
    width, height = _edit_size(probe, size, facts, limits)
    most = limits.max_frames if most is None else most
    try:
        if whole:  # one frame past the most tells a video that goes on
            frames, last = media.last_frame(data, most + 1, (width, height), MAX_CHECK_S)
        else:
            frames, last = media.count_frames(data, most, (width, height), MAX_CHECK_S), None
    except media.VideoDecodeError as exc:
        raise FieldError("video", str(exc)) from None
    if frames < 1:
        raise FieldError("video", "has no frame that decodes")
    if frames > most:
        raise FieldError("video", f"has more than {most} frames; this server extends videos of at most {most}")
    return SourceShape(width, height, frames, fps, last)


def _edit_size(probe: media.VideoProbe, size: str | None, facts: FamilyTraits, limits: Limits) -> tuple[int, int]:
    if size not in (None, "auto"):
        return parse_size(size, facts, limits)
    m = facts.size_multiple
    own = f"{probe.width - probe.width % m}x{probe.height - probe.height % m}"
    try:
        return parse_size(own, facts, limits)
    except FieldError as exc:
        raise FieldError("video", f"is {probe.width}x{probe.height}, so the edit would be {own}, and {exc.message}; "
                                  "pass 'size' to resize it") from None
