"""PNG pixels are exactly the pipeline's own PIL output; MP4s decode to the asked frames and size."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from deployments.models import families
from deployments.wire import media
from deployments.wire.spec import GenerationSpec
from zoo.tiny import ensure_tiny_wan


def test_png_pixels_equal_the_pipelines_pil_output():
    facts = families.read_family_traits(ensure_tiny_wan())
    pipe = families.load_full_pipeline(facts, torch.float32)
    spec = GenerationSpec("r", "a kite", None, 16, 32, 1, 2, 5.0, 9, 1)
    frames = families.reference_frames(pipe, facts, spec)
    pil = pipe("a kite", height=16, width=32, num_frames=1, num_inference_steps=2, guidance_scale=5.0,
               generator=families.generator_for(spec), output_type="pil").frames[0][0]
    decoded = Image.open(io.BytesIO(media.png_bytes(frames[0][0])))
    assert np.array_equal(np.asarray(decoded), np.asarray(pil))


def test_an_mp4_decodes_to_every_frame_at_the_asked_size():
    import imageio.v3 as iio

    video = torch.linspace(0, 1, 9 * 32 * 48 * 3).reshape(9, 32, 48, 3)
    frames = iio.imread(media.mp4_bytes(video, fps=8), extension=".mp4", plugin="FFMPEG")
    assert frames.shape == (9, 32, 48, 3)


def test_ffmpeg_is_started_without_a_preexec_fn_so_a_ray_replica_vforks_it(monkeypatch):
    """A preexec_fn makes CPython fork(), which runs gRPC's fork handlers in a Ray replica (they can abort the
    child before it becomes ffmpeg, and a job would complete with an empty mp4); without one it vforks."""
    import subprocess

    monkeypatch.delenv(media.FFMPEG_NO_PREEXEC_ENV, raising=False)
    started, popen = [], subprocess.Popen

    def spy(*args, **kwargs):
        started.append(kwargs.get("preexec_fn"))
        return popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", spy)
    media.mp4_bytes(torch.zeros(2, 16, 16, 3), fps=4)
    assert started and all(fn is None for fn in started), f"ffmpeg started with preexec_fn {started}"


def test_an_mp4_the_encoder_left_unfinished_is_an_error_naming_the_missing_box(monkeypatch):
    import imageio.v3 as iio
    import pytest

    whole = media.mp4_bytes(torch.zeros(3, 16, 16, 3), fps=4)
    media.check_mp4(whole)
    monkeypatch.setattr(iio, "imwrite", lambda *_args, **_kwargs: b"")  # what a child that died left
    with pytest.raises(media.VideoEncodeError, match="no ftyp, mdat, moov box"):
        media.mp4_bytes(torch.zeros(3, 16, 16, 3), fps=4)
    with pytest.raises(media.VideoEncodeError, match="claims"):
        media.check_mp4(whole[: len(whole) // 2])
    moov_at = whole.index(b"moov") - 4
    with pytest.raises(media.VideoEncodeError, match="no moov box"):
        media.check_mp4(whole[:moov_at])


def test_a_spritesheet_tiles_sixteen_frames_spread_from_the_first_to_the_last_at_most_256_px_a_side():
    video = torch.zeros(81, 480, 832, 3)
    for f in range(81):
        video[f, :, :, 0] = f / 80  # each frame's red level says which frame it is
    with Image.open(io.BytesIO(media.spritesheet_bytes(video))) as sheet:
        assert (sheet.format, sheet.size) == ("JPEG", (4 * 256, 4 * 148))
        reds = [sheet.getpixel((c * 256 + 128, r * 148 + 74))[0] for r in range(4) for c in range(4)]
    expected = [round(round(i * 80 / 15) / 80 * 255) for i in range(16)]  # frames 0, 5, 11, ..., 80
    assert all(abs(a - b) <= 3 for a, b in zip(reds, expected)), (reds, expected)


def test_a_video_edits_frames_decode_as_the_encoder_wrote_them_and_a_short_video_says_how_many_it_has():
    video = torch.linspace(0.1, 0.9, 5).view(5, 1, 1, 1).expand(5, 32, 48, 3).contiguous()  # a grey level a frame
    data = media.mp4_bytes(video, 4)
    frames = media.video_frames(data, 5)
    assert frames.shape == (5, 32, 48, 3)
    assert np.abs(frames.astype(int) - media.to_uint8(video)).max() <= 3, "in order, each within H.264's rounding"
    assert media.video_frames(data, 3, (16, 16)).shape == (3, 16, 16, 3)
    assert media.count_frames(data, 100, (48, 32)) == 5
    probe = media.video_probe(data)
    assert (probe.width, probe.height, probe.fps, probe.codec) == (48, 32, 4.0, "h264")
    with pytest.raises(media.VideoDecodeError, match="has 5 frames, 9 asked for"):
        media.video_frames(data, 9)


def test_a_scaled_decode_logs_no_warning_for_the_size_it_was_asked(caplog):
    data = media.mp4_bytes(torch.rand(3, 32, 48, 3), 4)
    with caplog.at_level("WARNING"):
        assert media.video_frames(data, 3, (16, 16)).shape == (3, 16, 16, 3)
    assert not [r for r in caplog.records if r.name.startswith("imageio")], caplog.text
