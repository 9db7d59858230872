"""What a video edit's or extension's source costs the ingress, at real sizes: checking an upload, and an
extension's decode, join and encode.

No model runs: the figures are the ffmpeg and NumPy work around the stages, on the ingress replica's worker
threads. A synthetic clip (a gradient with a moving square, ``--grain`` noise on it; H.264 as this server writes
it) stands in for the source: ``--source`` (default 1920x1080, a phone's) checked for an edit at ``--size`` (832x480, Wan's),
and ``--frames`` (81) of it; an extension adds ``--frames`` more. Medians of ``--reps``. Last line: one JSON
object.

    OMP_NUM_THREADS=1 .venv/bin/python bench/video_sources.py
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.api.videos.uploads import check_source_video  # noqa: E402
from deployments.capacity.request_limits import Limits  # noqa: E402
from deployments.models.families import read_family_traits  # noqa: E402
from deployments.wire import media  # noqa: E402
from zoo.tiny import ensure_tiny_wan  # noqa: E402


def clip(frames: int, width: int, height: int, grain: float = 0.0) -> torch.Tensor:
    """A gradient with a square crossing it; ``grain``: uniform noise of that amplitude on every pixel of every
    frame, which H.264 cannot predict (the clean clip compresses far better than footage, the grainy one worse)."""
    y, x = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    video = torch.stack([x, y, torch.full_like(x, 0.5)], dim=-1).repeat(frames, 1, 1, 1)
    side = height // 4
    for f in range(frames):
        left = f * (width - side) // max(1, frames - 1)
        video[f, side:2 * side, left:left + side] = 0.9
    if grain:
        noise = torch.rand(video.shape, generator=torch.Generator().manual_seed(0)) - 0.5
        video = (video + grain * noise).clamp(0, 1)
    return video


def timed(call) -> tuple[float, object]:
    start = time.perf_counter()
    value = call()
    return time.perf_counter() - start, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="1920x1080")
    parser.add_argument("--size", default="832x480")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--grain", type=float, default=0.0, help="noise amplitude on every pixel (0: a clean clip)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    source_w, source_h = (int(v) for v in args.source.split("x"))
    width, height = (int(v) for v in args.size.split("x"))
    facts = read_family_traits(ensure_tiny_wan())  # its size multiple (16) and temporal factor (4)
    limits = Limits(max_width=1280, max_height=1280, max_frames=args.frames)
    upload = media.mp4_bytes(clip(args.frames, source_w, source_h, args.grain), args.fps)
    own = media.mp4_bytes(clip(args.frames, width, height, args.grain), args.fps)  # a finished job's video
    made = clip(args.frames, width, height).flip(0)  # an extension's new frames, as the stages hand them over
    runs: dict[str, list[float]] = {k: [] for k in ("check_upload", "last_frame", "decode_source", "encode_alone",
                                                  "join_and_encode")}
    for _ in range(args.reps):
        runs["check_upload"].append(timed(lambda: check_source_video(upload, args.size, facts, limits))[0])
        runs["last_frame"].append(timed(lambda: media.last_frame(own, 2 * args.frames, (width, height)))[0])
        seconds, frames = timed(lambda: media.video_frames(own, args.frames, (width, height)))
        runs["decode_source"].append(seconds)
        runs["encode_alone"].append(timed(lambda: media.mp4_bytes(made, args.fps))[0])
        joined = lambda: media.mp4_bytes(np.concatenate([frames, media.to_uint8(made[1:])]), args.fps)  # noqa: E731
        runs["join_and_encode"].append(timed(joined)[0])
    medians = {k: round(statistics.median(v), 3) for k, v in runs.items()}
    for name, value in medians.items():
        print(f"{name:16} {value:8.3f} s")
    extension_extra = medians["last_frame"] + medians["decode_source"] + medians["join_and_encode"] \
        - medians["encode_alone"]
    print(json.dumps({"bench": "video_sources", "source": args.source, "size": args.size, "frames": args.frames,
                      "grain": args.grain, "upload_bytes": len(upload), "source_bytes": len(own), "reps": args.reps,
                      "seconds": medians,
                      # What an extension adds on the ingress over encoding its new frames alone.
                      "extension_extra_s": round(extension_extra, 3)}))


if __name__ == "__main__":
    main()
