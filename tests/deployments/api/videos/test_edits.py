"""Remixes (``POST /v1/videos/{id}/remix``, ``POST /v1/videos/edits``) over the Videos API in-process (fake stages).

The official client's ``videos.remix`` and ``videos.edit(video={"id": ...})`` queue a new job whose run is
the source's: its frames (the completed mp4's bytes), size, length, frame rate, steps, guidance, negative
prompt and seed, with the new prompt, the body's extras over them, and ``strength``. What the Denoiser does
with it is pinned in tests/deployments/models/test_edits.py, bitwise WanVideoToVideoPipeline.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json

import openai
import pytest

from deployments.jobs.runner import params_spec
from deployments.models.families import read_family_traits
from tests.deployments.video_fakes import FakePipeline, harness
from zoo import tiny

SOURCE = {"seconds": "2", "size": "32x16", "fps": 4, "seed": 3, "num_inference_steps": 4, "guidance_scale": 2.5,
          "negative_prompt": "blur"}


@dataclasses.dataclass
class SeeingPipeline(FakePipeline):
    """The fake pipeline, keeping each call's spec."""

    specs: list = dataclasses.field(default_factory=list)

    async def __call__(self, spec, on_progress):
        self.specs.append(spec)
        return await super().__call__(spec, on_progress)


def run(scenario):
    return asyncio.run(scenario)


def _client(h) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0, http_client=h.client)


async def _completed_source(h) -> tuple[str, bytes]:
    created = await h.client.post("/v1/videos", json={"prompt": "waves on a beach", **SOURCE})
    assert created.status_code == 200, created.text
    video_id = created.json()["id"]
    assert (await h.wait_for(video_id))["status"] == "completed"
    return video_id, (await h.client.get(f"/v1/videos/{video_id}/content")).content


def test_a_remix_is_a_new_job_on_the_completed_videos_frames_with_its_parameters_and_the_new_prompt(tmp_path):
    async def scenario():
        pipeline = SeeingPipeline()
        async with harness(tmp_path, pipeline=pipeline) as h:
            source_id, mp4 = await _completed_source(h)
            remix = await _client(h).videos.remix(source_id, prompt="waves at dawn")
            assert (remix.remixed_from_video_id, remix.status, remix.prompt) == (source_id, "queued", "waves at dawn")
            assert (remix.seconds, remix.size) == ("2", "32x16")
            done = await h.wait_for(remix.id)
            assert (done["status"], done["remixed_from_video_id"]) == ("completed", source_id)
            spec = pipeline.specs[-1]
            assert spec.reference_video == mp4, "the remix edits the completed video's own bytes"
            assert (spec.prompt, spec.width, spec.height, spec.num_frames, spec.steps, spec.guidance_scale,
                    spec.negative_prompt, spec.seed) == ("waves at dawn", 32, 16, 9, 4, 2.5, "blur", 3)
            # WanVideoToVideoPipeline's default strength 0.8 of 4 steps enters at 4 - int(3.2) = 1: 3 steps run.
            assert (spec.strength, spec.edit_start, spec.run_steps) == (0.8, 1, 3)
            source = (await h.client.get(f"/v1/videos/{source_id}")).json()
            assert source["remixed_from_video_id"] is None

    run(scenario())


def test_the_bodys_extras_override_the_sources_parameters(tmp_path):
    async def scenario():
        pipeline = SeeingPipeline()
        async with harness(tmp_path, pipeline=pipeline) as h:
            source_id, _ = await _completed_source(h)
            remix = await _client(h).videos.remix(source_id, prompt="waves at dawn", extra_body={
                "strength": 0.5, "seed": 9, "num_inference_steps": 6, "guidance_scale": 1.0, "negative_prompt": None})
            await h.wait_for(remix.id)
            spec = pipeline.specs[-1]
            assert (spec.strength, spec.seed, spec.steps, spec.guidance_scale, spec.negative_prompt) == \
                (0.5, 9, 6, 1.0, None)
            assert spec.run_steps == 3 and (spec.num_frames, spec.width) == (9, 32)

    run(scenario())


def test_videos_edits_naming_a_completed_video_in_json_or_a_form_is_its_remix(tmp_path):
    async def scenario():
        pipeline = SeeingPipeline()
        async with harness(tmp_path, pipeline=pipeline) as h:
            source_id, mp4 = await _completed_source(h)
            as_json = await h.client.post("/v1/videos/edits", json={"prompt": "waves at dawn", "strength": 0.6,
                                                                    "video": {"id": source_id}})
            as_form = await h.client.post("/v1/videos/edits", files={  # curl -F 'video[id]=video_...'
                "prompt": (None, "waves at dawn"), "strength": (None, "0.6"), "video[id]": (None, source_id)})
            for response in (as_json, as_form):
                assert response.status_code == 200, response.text
                assert response.json()["remixed_from_video_id"] == source_id
                await h.wait_for(response.json()["id"])
            body, form = pipeline.specs[-2:]
            assert form.reference_video == body.reference_video == mp4
            assert dataclasses.replace(form, request_id="") == dataclasses.replace(body, request_id="")
            assert form.strength == 0.6

    run(scenario())


def test_a_queued_remix_keeps_its_sources_frames_when_the_source_is_deleted_before_it_runs(tmp_path):
    async def scenario():
        pipeline = SeeingPipeline()
        async with harness(tmp_path, pipeline=pipeline) as h:
            source_id, mp4 = await _completed_source(h)
            pipeline.gate = asyncio.Event()
            remix = await _client(h).videos.remix(source_id, prompt="waves at dawn")
            assert (await h.client.delete(f"/v1/videos/{source_id}")).status_code == 200
            assert h.service.results.get_source(remix.id) == mp4, "kept beside the remix's results"
            assert h.service.get(remix.id).params.source_video is True
            pipeline.gate.set()
            assert (await h.wait_for(remix.id))["status"] == "completed"
            assert pipeline.specs[-1].reference_video == mp4

    run(scenario())


@pytest.mark.parametrize("body, param", [
    ({"strength": 0}, "strength"),
    ({"strength": 1.5}, "strength"),
    ({"strength": 0.2}, "strength"),  # 4 - int(4 x 0.2) = 4: no step would run
    ({"seconds": "4"}, "seconds"),  # a remix keeps its source's length
    ({"size": "16x16"}, "size"),
    ({"prompt": ""}, "prompt"),
    ({"num_inference_steps": 1000}, "num_inference_steps"),
    ({"lora": "ink"}, "lora"),
    ({"model": "sora-2"}, "model"),
])
def test_a_bad_remix_field_gets_the_openai_error_naming_it_and_queues_nothing(tmp_path, body, param):
    async def scenario():
        async with harness(tmp_path) as h:
            source_id, _ = await _completed_source(h)
            response = await h.client.post(f"/v1/videos/{source_id}/remix",
                                           content=json.dumps({"prompt": "waves at dawn", **body}),
                                           headers={"content-type": "application/json"})
            assert response.status_code in (400, 404), response.text
            assert response.json()["error"]["param"] == param
            if param in ("seconds", "size"):
                assert "a remix keeps its source's" in response.json()["error"]["message"]
            assert [j.id for j in h.service.list(None, 10, "desc").jobs] == [source_id]

    run(scenario())


def test_a_remix_of_an_unknown_unfinished_or_vanished_video_names_it(tmp_path):
    async def scenario():
        async with harness(tmp_path, pipeline=SeeingPipeline()) as h:
            source_id, _ = await _completed_source(h)
            for video_id in ("video_000000000000000000000000", "not-a-video", "video_0000000000000000000000zz"):
                missing = await h.client.post(f"/v1/videos/{video_id}/remix", json={"prompt": "x"})
                assert missing.status_code == 404 and missing.json()["error"]["code"] == "video_not_found"
            h.pipeline.gate = asyncio.Event()
            running = (await h.client.post("/v1/videos", json={"prompt": "a cat"})).json()["id"]
            early = await h.client.post(f"/v1/videos/{running}/remix", json={"prompt": "x"})
            assert early.status_code == 409 and early.json()["error"]["code"] == "video_not_ready"
            h.pipeline.gate.set()
            h.service.results.delete(h.service.get(source_id).result_key)
            gone = await h.client.post(f"/v1/videos/{source_id}/remix", json={"prompt": "x"})
            assert gone.status_code == 404 and "gone" in gone.json()["error"]["message"]

    run(scenario())


@pytest.mark.parametrize("video, param", [
    (None, "video"),
    ({"url": "http://x/y.mp4"}, "video"),
    ({"id": 7}, "video"),
    ("video_000000000000000000000000", "video"),  # an id is {"id": ...}
    ({"id": "video_000000000000000000000000"}, "video_id"),
])
def test_videos_edits_needs_an_upload_or_a_completed_videos_id(tmp_path, video, param):
    async def scenario():
        async with harness(tmp_path) as h:
            body = {"prompt": "waves at dawn"} | ({} if video is None else {"video": video})
            response = await h.client.post("/v1/videos/edits", json=body)
            assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, response.text

    run(scenario())


def test_a_family_that_does_not_edit_videos_refuses_a_remix_naming_the_model(tmp_path, monkeypatch):
    async def scenario():
        async with harness(tmp_path) as h:
            source_id, _ = await _completed_source(h)
            jobs = h.client._transport.app.state.video_jobs
            facts = read_family_traits(tiny.ensure_tiny_wan())
            jobs.config = dataclasses.replace(jobs.config, facts=dataclasses.replace(facts, modalities=("image", "video")))
            response = await h.client.post(f"/v1/videos/{source_id}/remix", json={"prompt": "x"})
            assert response.status_code == 400 and response.json()["error"]["param"] == "model"

    run(scenario())


def test_a_remix_job_record_reads_back_as_the_same_edit():
    from deployments.jobs.records import JobParams

    params = JobParams("p", None, 32, 16, 9, 4, 4, 2.5, 3, "2", source_video=True, strength=0.8,
                       remixed_from="video_" + "0" * 24)
    again = JobParams(**json.loads(json.dumps(dataclasses.asdict(params))))
    assert again == params
    spec = params_spec(again, "r", b"mp4")
    assert (spec.reference_video, spec.strength, spec.run_steps) == (b"mp4", 0.8, 3)
    plain = params_spec(dataclasses.replace(again, source_video=False, strength=None), "r")
    assert (plain.reference_video, plain.strength, plain.run_steps) == (None, None, 4)


def a_clip(frames: int = 11, width: int = 56, height: int = 40, fps: int = 8, **options) -> bytes:
    """An H.264 mp4 as a phone or an editor makes one: its own size (here not a multiple of the model's 16) and
    frame rate, a frame count the VAE does not take whole (11 = 1 + 4 x 2.5)."""
    import torch

    from deployments.wire import media

    if options:
        import imageio.v3 as iio

        video = (torch.rand(frames, height, width, 3, generator=torch.Generator().manual_seed(0)) * 255).byte().numpy()
        return iio.imwrite("<bytes>", video, extension=".mp4", fps=fps, plugin="FFMPEG", macro_block_size=1, **options)
    return media.mp4_bytes(torch.rand(frames, height, width, 3, generator=torch.Generator().manual_seed(0)), fps)


def test_the_clients_videos_edit_of_an_uploaded_clip_edits_its_frames_at_its_own_size_and_frame_rate(tmp_path):
    async def scenario():
        pipeline = SeeingPipeline()
        async with harness(tmp_path, pipeline=pipeline) as h:
            clip = a_clip()
            edited = await _client(h).videos.edit(prompt="waves at dawn", video=("clip.mp4", clip, "video/mp4"),
                                                  extra_body={"seed": 4, "strength": 0.5})
            # 56x40 rounded down to the model's multiple of 16; 11 frames to the 9 its VAE takes (1 + 4 x 2),
            # within the server's 9: 1 s at the clip's 8 fps.
            assert (edited.size, edited.seconds, edited.remixed_from_video_id) == ("48x32", "1", None)
            assert (await h.wait_for(edited.id))["status"] == "completed"
            spec = pipeline.specs[-1]
            assert spec.reference_video == clip and h.service.results.get_source(edited.id) == clip
            assert (spec.num_frames, spec.width, spec.height, spec.seed, spec.strength) == (9, 48, 32, 4, 0.5)
            assert (spec.steps, spec.guidance_scale) == (2, 5.0), "the server's defaults, as for POST /v1/videos"
            assert h.service.get(edited.id).params.fps == 8
            video = (await h.client.get(f"/v1/videos/{edited.id}/content")).content
            assert h.service.get(edited.id).status.value == "completed" and video[4:8] == b"ftyp"
            assert (await h.client.delete(f"/v1/videos/{edited.id}")).status_code == 200
            assert h.service.results.get_source(edited.id) is None, "deleting the job deletes its source"

    run(scenario())


def test_size_resizes_an_upload_and_seconds_takes_its_beginning(tmp_path):
    async def scenario():
        pipeline = SeeingPipeline()
        async with harness(tmp_path, pipeline=pipeline) as h:
            response = await h.client.post("/v1/videos/edits", files={
                "video": ("clip.mp4", a_clip(), "video/mp4"), "prompt": (None, "waves"), "size": (None, "16x16"),
                "seconds": (None, "0.5")})
            assert response.status_code == 200, response.text
            await h.wait_for(response.json()["id"])
            spec = pipeline.specs[-1]
            assert (spec.width, spec.height, spec.num_frames) == (16, 16, 5), "0.5 s at 8 fps: 5 frames"
            too_long = await h.client.post("/v1/videos/edits", files={
                "video": ("clip.mp4", a_clip(), "video/mp4"), "prompt": (None, "waves"), "seconds": (None, "2")})
            assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "seconds"
            assert "at most 1 s" in too_long.json()["error"]["message"]

    run(scenario())


def _png() -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (32, 32)).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("upload, fields, words", [
    (b"", {}, "is empty"),
    (_png(), {}, "not an mp4 or mov file"),
    (a_clip()[:-200], {}, "not an mp4 or mov file"),  # cut short: its mdat box claims more than there is
    (b"\x00\x00\x00\x10ftypisom\x00\x00\x00\x00" + b"\x00\x00\x00\x08moov" + b"\x00\x00\x00\x08mdat", {},
     "no video header"),
    (a_clip(width=96, height=96), {}, "pass 'size' to resize it"),  # 96x96 > the server's 64x64
    (a_clip(fps=100), {}, "runs at 100 frames per second"),
    (a_clip(codec="mjpeg"), {}, "send av1, h264"),
])
def test_an_upload_that_is_not_a_video_this_server_edits_is_a_400_naming_video(tmp_path, upload, fields, words):
    async def scenario():
        async with harness(tmp_path) as h:
            response = await h.client.post("/v1/videos/edits", files={
                "video": ("clip.mp4", upload, "video/mp4"), "prompt": (None, "waves"),
                **{k: (None, v) for k, v in fields.items()}})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "video" and words in error["message"], error
            assert h.service.list(None, 10, "desc").jobs == ()
            assert not any(p.name.endswith(".source.mp4") for p in (tmp_path / "test-app-results").iterdir())

    run(scenario())


def test_an_upload_over_the_bound_is_a_413_before_anything_reads_it(tmp_path, monkeypatch):
    from deployments.api.videos import edit_jobs as video_edit_jobs

    monkeypatch.setattr(video_edit_jobs, "MAX_SOURCE_VIDEO_BYTES", 10_000)

    async def scenario():
        async with harness(tmp_path) as h:
            response = await h.client.post("/v1/videos/edits", files={
                "video": ("clip.mp4", b"\x00" * 2_000_000, "video/mp4"), "prompt": (None, "waves")})
            assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"

    run(scenario())


def test_a_remix_with_a_video_in_its_body_is_refused_naming_it(tmp_path):
    async def scenario():
        async with harness(tmp_path) as h:
            source_id, _ = await _completed_source(h)
            response = await h.client.post(f"/v1/videos/{source_id}/remix",
                                           json={"prompt": "x", "video": {"id": source_id}})
            assert response.status_code == 400 and response.json()["error"]["param"] == "video"

    run(scenario())


def test_an_expired_edit_takes_its_source_video_with_it(tmp_path):
    async def scenario():
        async with harness(tmp_path) as h:
            response = await h.client.post("/v1/videos/edits", files={
                "video": ("clip.mp4", a_clip(), "video/mp4"), "prompt": (None, "waves")})
            edit_id = response.json()["id"]
            done = await h.wait_for(edit_id)
            names = sorted(p.name for p in (tmp_path / "test-app-results").iterdir())
            assert names == [f"{edit_id}-1.jpg", f"{edit_id}-1.mp4", f"{edit_id}-1.png", f"{edit_id}.source.mp4"]
            h.clock.now = done["expires_at"]
            for _ in range(100):
                if not any((tmp_path / "test-app-results").iterdir()):
                    break
                await asyncio.sleep(0.05)
            assert list((tmp_path / "test-app-results").iterdir()) == []

    run(scenario())


def test_an_edit_whose_source_video_vanished_fails_saying_so(tmp_path):
    from deployments.jobs.records import JobParams, new_job, new_job_id

    async def scenario():
        async with harness(tmp_path) as h:
            # A job record whose source the results location lost (a wiped volume): nothing to edit.
            params = JobParams("waves", None, 32, 16, 9, 4, 4, 1.0, 3, "2", source_video=True, strength=0.8)
            job = h.service.create(new_job(new_job_id(h.clock.now), "tiny-wan", params, int(h.clock.now)))
            h.runner.wake()
            failed = await h.wait_for(job.id)
            assert failed["status"] == "failed" and "SourceVideoGone" in failed["error"]["message"], failed
            assert "the source video of" in failed["error"]["message"]

    run(scenario())


def test_a_remix_keeps_its_sources_adapter_unless_it_names_another_or_only_a_scale(tmp_path):
    from deployments.models.lora_rows import ServedLora

    loras = (ServedLora("ink", "/srv/loras/ink.safetensors", 0.8), ServedLora("neon", "/srv/loras/neon", 1.0))

    async def scenario():
        pipeline = SeeingPipeline()
        async with harness(tmp_path, pipeline=pipeline, loras=loras) as h:
            created = await h.client.post("/v1/videos", json={"prompt": "waves", **SOURCE, "lora": "ink",
                                                              "lora_scale": 0.5})
            source_id = created.json()["id"]
            await h.wait_for(source_id)
            seen = []
            for extra in ({}, {"lora_scale": 1.5}, {"lora": "neon"}, {"lora": None}):
                remix = await h.client.post(f"/v1/videos/{source_id}/remix", json={"prompt": "x", **extra})
                assert remix.status_code == 200, remix.text
                await h.wait_for(remix.json()["id"])
                seen.append((pipeline.specs[-1].lora, pipeline.specs[-1].lora_scale if pipeline.specs[-1].lora else None))
            assert seen == [("ink", 0.5), ("ink", 1.5), ("neon", 1.0), (None, None)]

    run(scenario())


def test_a_remix_of_a_source_longer_than_one_request_may_be_names_it():
    # An extension's video (its source's frames and its own), or one made before max_frames was lowered.
    from deployments.api.videos.edits import VideoEditRequest, remix_base
    from deployments.capacity.request_limits import FieldError
    from deployments.jobs.records import JobParams, new_job
    from tests.deployments.video_fakes import LIMITS

    params = JobParams("p", None, 32, 16, 5, 4, 4, 2.5, 3, "3", extends=True, source_video=True, source_frames=9)
    job = new_job("video_" + "0" * 24, "tiny-wan", params, 0)
    with pytest.raises(FieldError) as refused:
        remix_base(VideoEditRequest(prompt="x"), job, LIMITS)
    assert refused.value.param == "video_id" and "has 13 frames" in refused.value.message
    assert remix_base(VideoEditRequest(prompt="x"), new_job(job.id, "m", dataclasses.replace(params, extends=False), 0),
                      LIMITS).num_frames == 5


def test_an_upload_that_decodes_slower_than_the_checks_bound_is_refused_not_waited_for(tmp_path, monkeypatch):
    from deployments.api.videos import uploads as source_videos

    monkeypatch.setattr(source_videos, "MAX_CHECK_S", 0.0)

    async def scenario():
        async with harness(tmp_path) as h:
            response = await h.client.post("/v1/videos/edits", files={
                "video": ("clip.mp4", a_clip(), "video/mp4"), "prompt": (None, "waves")})
            assert response.status_code == 400 and response.json()["error"]["param"] == "video"
            assert "took more than 0 s to decode" in response.json()["error"]["message"]

    run(scenario())
