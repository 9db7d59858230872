"""Extensions (``POST /v1/videos/extensions``, OpenAI's ``videos.extend``) over the Videos API in-process (fake stages).

On a family that makes a video from an image (here the tiny Wan2.2 I2V), an extension is an image-to-video
job from the source's last frame (as decoded, at the source's size and frame rate); the runner puts the
source's frames before the new ones, without the new first frame (the source's last again).
"""
from __future__ import annotations

import asyncio
import base64
import io

import imageio.v3 as iio
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from deployments.wire import media
from tests.deployments.api.videos.test_edits import SeeingPipeline, a_clip
from tests.deployments.video_fakes import harness
from zoo.wan22 import ensure_tiny_wan22_i2v

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def run(scenario):
    return asyncio.run(scenario)


def _png(side: int = 32) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (side, side), (200, 40, 40)).save(out, format="PNG")
    return out.getvalue()


async def _completed_source(h) -> tuple[str, bytes]:
    reference = "data:image/png;base64," + base64.b64encode(_png()).decode()
    created = await h.client.post("/v1/videos", json={"prompt": "waves", "seconds": "2", "size": "32x32", "fps": 4,
                                                      "seed": 3, "input_reference": reference})
    assert created.status_code == 200, created.text
    video_id = created.json()["id"]
    assert (await h.wait_for(video_id))["status"] == "completed"
    return video_id, (await h.client.get(f"/v1/videos/{video_id}/content")).content


def _client(h) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0, http_client=h.client)


def test_an_extension_goes_on_from_the_videos_last_frame_after_all_its_frames(tmp_path):
    async def scenario():
        pipeline = SeeingPipeline()
        async with harness(tmp_path, pipeline=pipeline, folder=ensure_tiny_wan22_i2v) as h:
            source_id, mp4 = await _completed_source(h)
            extended = await h.client.post("/v1/videos/extensions", json={
                "prompt": "the waves calm", "seconds": "1", "video": {"id": source_id}, "seed": 5})
            assert extended.status_code == 200, extended.text
            # 9 frames, then 1 s at 4 fps (5 frames) from the last, that one not twice: 13 frames, 3 s.
            assert (extended.json()["seconds"], extended.json()["size"]) == ("3", "32x32")
            done = await h.wait_for(extended.json()["id"])
            assert done["status"] == "completed", done
            spec = pipeline.specs[-1]
            assert (spec.prompt, spec.num_frames, spec.seed, spec.strength, spec.reference_video) == \
                ("the waves calm", 5, 5, None, None)
            source_frames = media.video_frames(mp4, 9)
            with Image.open(io.BytesIO(spec.reference_image)) as reference:
                assert np.array_equal(np.asarray(reference), source_frames[-1]), "the source's last frame, as decoded"
            video = (await h.client.get(f"/v1/videos/{done['id']}/content")).content
            frames = iio.imread(video, extension=".mp4", plugin="FFMPEG")
            assert frames.shape == (13, 32, 32, 3)
            made = media.to_uint8(torch.rand(5, 32, 32, 3, generator=torch.Generator().manual_seed(5)))  # the fake's
            # Through a second H.264 encode: the source's frames first, then the new ones but their first.
            assert np.abs(frames[:9].astype(int) - source_frames).mean() < 8
            assert np.abs(frames[9:].astype(int) - made[1:]).mean() < np.abs(frames[9:].astype(int) - made[:4]).mean()

    run(scenario())


def test_the_clients_videos_extend_of_an_uploaded_clip_keeps_all_its_frames(tmp_path):
    async def scenario():
        pipeline = SeeingPipeline()
        async with harness(tmp_path, pipeline=pipeline, folder=ensure_tiny_wan22_i2v) as h:
            clip = a_clip()  # 56x40 at 8 fps, 11 frames: at 48x32 (the model's multiple of 16)
            extended = await _client(h).videos.extend(prompt="on and on", seconds="1",
                                                      video=("clip.mp4", clip, "video/mp4"))
            # 11 frames, then 1 s at 8 fps (9 frames) less the first: 19 frames, 2.25 s.
            assert (extended.size, extended.seconds, extended.remixed_from_video_id) == ("48x32", "2.25", None)
            done = await h.wait_for(extended.id)
            assert done["status"] == "completed", done
            assert pipeline.specs[-1].num_frames == 9 and h.service.results.get_source(extended.id) == clip
            video = (await h.client.get(f"/v1/videos/{extended.id}/content")).content
            assert iio.imread(video, extension=".mp4", plugin="FFMPEG").shape == (19, 32, 48, 3)

    run(scenario())


@pytest.mark.parametrize("body, param, words", [
    ({}, "seconds", "Field required"),
    ({"seconds": "3"}, "seconds", "at most 9 at once"),  # 13 frames at 4 fps
    ({"seconds": "1", "strength": 0.5}, "strength", "Extra inputs"),
    ({"seconds": "1", "video": {"id": "video_000000000000000000000000"}}, "video_id", "no video"),
    ({"seconds": "1", "video": None}, "video", "required"),
])
def test_a_bad_extension_is_a_400_naming_the_field(tmp_path, body, param, words):
    async def scenario():
        async with harness(tmp_path, folder=ensure_tiny_wan22_i2v) as h:
            source_id, _ = await _completed_source(h)
            full = {"prompt": "x", "video": {"id": source_id}, **body}
            response = await h.client.post("/v1/videos/extensions", json={k: v for k, v in full.items()
                                                                           if v is not None})
            assert response.status_code in (400, 404), response.text
            error = response.json()["error"]
            assert error["param"] == param and words in error["message"], error
            assert [j.id for j in h.service.list(None, 10, "desc").jobs] == [source_id]

    run(scenario())


def test_an_uploaded_video_longer_than_twice_the_frames_one_request_makes_is_refused(tmp_path):
    async def scenario():
        async with harness(tmp_path, folder=ensure_tiny_wan22_i2v) as h:
            response = await h.client.post("/v1/videos/extensions", files={
                "video": ("clip.mp4", a_clip(frames=19), "video/mp4"), "prompt": (None, "x"), "seconds": (None, "1")})
            assert response.status_code == 400 and response.json()["error"]["param"] == "video"
            assert "more than 18 frames" in response.json()["error"]["message"]
            fits = await h.client.post("/v1/videos/extensions", files={
                "video": ("clip.mp4", a_clip(frames=18), "video/mp4"), "prompt": (None, "x"), "seconds": (None, "1")})
            assert fits.status_code == 200, fits.text

    run(scenario())


def test_a_family_that_makes_no_video_from_an_image_refuses_to_extend_naming_the_model(tmp_path):
    async def scenario():
        async with harness(tmp_path) as h:  # the tiny Wan2.1: text to video only
            response = await h.client.post("/v1/videos/extensions", files={
                "video": ("clip.mp4", a_clip(), "video/mp4"), "prompt": (None, "x"), "seconds": (None, "1")})
            assert response.status_code == 400 and response.json()["error"]["param"] == "model"
            assert "image-to-video generation from the video's last frame" in response.json()["error"]["message"]

    run(scenario())


def test_an_extended_video_is_extended_again_from_its_own_last_frame_and_is_too_long_to_remix_at_once(tmp_path):
    async def scenario():
        pipeline = SeeingPipeline()
        async with harness(tmp_path, pipeline=pipeline, folder=ensure_tiny_wan22_i2v) as h:
            source_id, _ = await _completed_source(h)  # 9 frames
            once = await h.client.post("/v1/videos/extensions", json={"prompt": "x", "seconds": "1",
                                                                      "video": {"id": source_id}})
            await h.wait_for(once.json()["id"])  # 13 frames
            mp4 = (await h.client.get(f"/v1/videos/{once.json()['id']}/content")).content
            twice = await h.client.post("/v1/videos/extensions", json={"prompt": "x", "seconds": "1",
                                                                       "video": {"id": once.json()["id"]}})
            assert twice.status_code == 200 and twice.json()["seconds"] == "4", twice.text  # 17 frames at 4 fps
            await h.wait_for(twice.json()["id"])
            with Image.open(io.BytesIO(pipeline.specs[-1].reference_image)) as reference:
                assert np.array_equal(np.asarray(reference), media.video_frames(mp4, 13)[-1])
            thrice = await h.client.post("/v1/videos/extensions", json={"prompt": "x", "seconds": "1",
                                                                        "video": {"id": twice.json()["id"]}})
            assert thrice.status_code == 200, thrice.text  # 17 <= 18
            done = await h.wait_for(thrice.json()["id"])
            again = await h.client.post("/v1/videos/extensions", json={"prompt": "x", "seconds": "1",
                                                                       "video": {"id": done["id"]}})
            assert again.status_code == 400 and "has 21 frames" in again.json()["error"]["message"]

    run(scenario())
