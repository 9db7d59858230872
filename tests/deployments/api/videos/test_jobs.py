"""The Videos API's routes, job queue and runner in-process (fake stages): the job lifecycle end to end."""
from __future__ import annotations

import asyncio
import io
import json

import imageio.v3 as iio
import pytest
from PIL import Image
from ray import exceptions as ray_errors
from ray.serve import exceptions as serve_errors

from deployments.capacity.admission import StageAdmission
from deployments.capacity.replica_report import ReplicaResidency
from deployments.jobs.records import JobParams, new_job, new_job_id
from deployments.models.activation_features import Regime
from deployments.wire.spec import PipelineStage
from offload_core.planner.activation_model import ActivationModel
from tests.deployments.fakes import FakeBoard
from tests.deployments.video_fakes import CancellableStages, FakePipeline, harness


def run(scenario):
    return asyncio.run(scenario)


async def _create(h, **body) -> dict:
    response = await h.client.post("/v1/videos", json={"prompt": "waves on a beach", **body})
    assert response.status_code == 200, response.text
    return response.json()


def _result_files(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "test-app-results").iterdir())


def test_a_job_is_queued_then_completes_with_an_mp4_of_the_asked_frames_and_size(tmp_path):
    async def scenario():
        async with harness(tmp_path) as h:
            created = await _create(h, seconds="2", size="32x16", fps=4, seed=3)
            assert (created["object"], created["status"], created["progress"]) == ("video", "queued", 0)
            assert (created["seconds"], created["size"], created["model"]) == ("2", "32x16", "tiny-wan")
            done = await h.wait_for(created["id"])
            assert (done["status"], done["progress"], done["error"]) == ("completed", 100, None)
            assert done["expires_at"] == done["completed_at"] + 600
            video = await h.client.get(f"/v1/videos/{created['id']}/content")
            assert video.headers["content-type"] == "video/mp4"
            frames = iio.imread(video.content, extension=".mp4", plugin="FFMPEG")
            assert frames.shape == (9, 16, 32, 3), "2 s at 4 fps is 9 frames"
            thumb = await h.client.get(f"/v1/videos/{created['id']}/content", params={"variant": "thumbnail"})
            assert Image.open(io.BytesIO(thumb.content)).size == (32, 16)
            sheet = await h.client.get(f"/v1/videos/{created['id']}/content", params={"variant": "spritesheet"})
            assert sheet.headers["content-type"] == "image/jpeg"
            with Image.open(io.BytesIO(sheet.content)) as tiles:  # all 9 frames, 3 by 3
                assert (tiles.format, tiles.size) == ("JPEG", (3 * 32, 3 * 16))

    run(scenario())


def test_multipart_fields_arrive_as_strings_and_are_read_as_numbers(tmp_path):
    async def scenario():
        async with harness(tmp_path) as h:
            fields = {"prompt": "a fox", "seconds": "1", "fps": "4", "seed": "7", "num_inference_steps": "3",
                      "guidance_scale": "2.5", "negative_prompt": "blur"}
            response = await h.client.post("/v1/videos", files={k: (None, v) for k, v in fields.items()})
            assert response.status_code == 200, response.text
            params = h.service.get(response.json()["id"]).params
            assert (params.seed, params.steps, params.guidance_scale, params.num_frames, params.fps) == \
                (7, 3, 2.5, 5, 4)
            assert params.negative_prompt == "blur"

    run(scenario())


@pytest.mark.parametrize("body, param, status", [
    ({"seconds": "3"}, "seconds", 400),  # 3 s at 4 fps is 13 frames > 9
    ({"seconds": "-1"}, "seconds", 400),
    ({"seconds": "1e3"}, "seconds", 400),
    ({"size": "24x16"}, "size", 400),
    ({"size": "720x1280"}, "size", 400),
    ({"num_inference_steps": 0}, "num_inference_steps", 400),
    ({"seed": "abc"}, "seed", 400),
    ({"fps": 100}, "fps", 400),
    ({"model": "sora-2"}, "model", 404),
    ({"input_reference": {"image_url": "http://x/y.png"}}, "input_reference", 400),
    ({"style": "vivid"}, "style", 400),
    ({"prompt": ""}, "prompt", 400),
    ({"prompt": "\ud800"}, "prompt", 400),
    ({"user": "u" * 1000}, "user", 400),
    ({"seconds": "\uff11"}, "seconds", 400),  # a full-width digit one
])
def test_a_bad_field_gets_the_openai_error_object_naming_it(tmp_path, body, param, status):
    async def scenario():
        async with harness(tmp_path) as h:
            # json.dumps escapes a lone surrogate as \\ud800, as a client's JSON encoder would.
            response = await h.client.post("/v1/videos", content=json.dumps({"prompt": "a cat", **body}),
                                           headers={"content-type": "application/json"})
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
            assert h.service.list(None, 10, "desc").jobs == (), "a refused request must not become a job"

    run(scenario())


def test_bodies_that_are_neither_json_nor_a_form_get_415_and_broken_json_400(tmp_path):
    async def scenario():
        async with harness(tmp_path) as h:
            plain = await h.client.post("/v1/videos", content=b"prompt=a cat", headers={"content-type": "text/plain"})
            assert plain.status_code == 415 and plain.json()["error"]["code"] == "unsupported_media_type"
            deep = await h.client.post("/v1/videos", content=b"[" * 5000, headers={"content-type": "application/json"})
            assert deep.status_code == 400 and deep.json()["error"]["param"] == "body"
            broken = await h.client.post("/v1/videos", content=b'{"prompt": ', headers={"content-type":
                                                                                           "application/json"})
            assert broken.status_code == 400 and broken.json()["error"]["param"] == "body"
            upload = await h.client.post("/v1/videos", data={"prompt": "a cat"},
                                         files={"input_reference": ("ref.png", b"\x89PNG", "image/png")})
            assert upload.status_code == 400 and upload.json()["error"]["param"] == "input_reference"

    run(scenario())


def test_progress_follows_the_denoising_steps(tmp_path):
    async def scenario():
        pipeline = FakePipeline(gate=asyncio.Event())
        async with harness(tmp_path, pipeline=pipeline) as h:
            video_id = (await _create(h, num_inference_steps=4))["id"]
            seen = [(await h.wait_for(video_id, statuses=("in_progress",)))["progress"]]
            pipeline.gate.set()
            for _ in range(20_000):
                body = (await h.client.get(f"/v1/videos/{video_id}")).json()
                if body["progress"] != seen[-1]:
                    seen.append(body["progress"])
                if body["status"] != "in_progress":
                    break
                await asyncio.sleep(0)
            assert body["status"] == "completed", body
            assert seen[0] == 0 and seen[-1] == 100
            assert set(seen) <= {0, 20, 40, 60, 80, 100}, "step k of 4 is k/5 of the job"
            assert seen == sorted(seen)

    run(scenario())


def test_deleting_a_running_job_stops_it_at_the_next_step_and_removes_it(tmp_path):
    async def scenario():
        pipeline = FakePipeline(step_s=0.01)
        async with harness(tmp_path, pipeline=pipeline) as h:
            video_id = (await _create(h, num_inference_steps=50))["id"]
            while (await h.client.get(f"/v1/videos/{video_id}")).json()["progress"] == 0:
                await asyncio.sleep(0.005)
            deleted = await h.client.delete(f"/v1/videos/{video_id}")
            assert deleted.json() == {"id": video_id, "object": "video.deleted", "deleted": True}
            at_delete = pipeline.steps_run
            await asyncio.sleep(0.2)  # 20 more steps' time
            assert pipeline.steps_run <= at_delete + 1, "the run went on after the delete"
            assert h.runner.running == frozenset()
            assert (await h.client.get(f"/v1/videos/{video_id}")).status_code == 404
            assert _result_files(tmp_path) == []

    run(scenario())


def test_deleting_a_running_job_cancels_the_denoisers_call_through_the_service_drive(tmp_path):
    async def scenario():
        stages = CancellableStages(hold=asyncio.Event())  # the denoiser waits before step 2
        async with harness(tmp_path, stages=stages) as h:
            video_id = (await _create(h, num_inference_steps=8))["id"]
            while (await h.client.get(f"/v1/videos/{video_id}")).json()["progress"] == 0:
                await asyncio.sleep(0.005)
            assert (await h.client.delete(f"/v1/videos/{video_id}")).json()["deleted"] is True
            # The runner's task leaves ``running`` as it unwinds, a few awaits after it cancels the stream:
            # wait for both (a clean clone under load read ``running`` between the two, 2bc6b45).
            for _ in range(200):
                if stages.stream_cancels and not h.runner.running:
                    break
                await asyncio.sleep(0.01)
            assert stages.stream_cancels == [True], "the Denoiser's call was left running"
            assert stages.steps_done[video_id] == 1 and h.runner.running == frozenset()
            assert ("decode", video_id) not in stages.calls

    run(scenario())


def test_a_job_deleted_through_another_replica_stops_at_its_next_step(tmp_path):
    async def scenario():
        pipeline = FakePipeline(step_s=0.01)
        async with harness(tmp_path, pipeline=pipeline) as h:
            video_id = (await _create(h, num_inference_steps=50))["id"]
            await h.wait_for(video_id, statuses=("in_progress",))
            while pipeline.steps_run == 0:
                await asyncio.sleep(0.005)
            assert h.service.delete(video_id) is not None  # the queue, as another replica's DELETE reaches it
            at_delete = pipeline.steps_run
            await asyncio.sleep(0.2)
            assert pipeline.steps_run <= at_delete + 1
            assert h.runner.running == frozenset()

    run(scenario())


def test_a_queued_job_deleted_before_it_runs_never_runs(tmp_path):
    async def scenario():
        pipeline = FakePipeline(gate=asyncio.Event())
        async with harness(tmp_path, pipeline=pipeline, max_running_per_ingress=1) as h:
            first = (await _create(h))["id"]
            second = (await _create(h))["id"]
            await h.wait_for(first, statuses=("in_progress",))
            assert (await h.client.delete(f"/v1/videos/{second}")).json()["deleted"] is True
            pipeline.gate.set()
            assert (await h.wait_for(first))["status"] == "completed"
            assert pipeline.calls == [first]
            deleted = await h.client.delete(f"/v1/videos/{first}")
            assert deleted.status_code == 200 and _result_files(tmp_path) == [], "the result goes with the job"
            assert (await h.client.delete(f"/v1/videos/{first}")).status_code == 404

    run(scenario())


def test_expired_jobs_and_their_results_are_deleted(tmp_path):
    async def scenario():
        async with harness(tmp_path) as h:
            video_id = (await _create(h))["id"]
            done = await h.wait_for(video_id)
            assert len(_result_files(tmp_path)) == 3  # the mp4, its thumbnail and its spritesheet
            h.clock.now = done["expires_at"] - 1
            await asyncio.sleep(0.5)  # more than one sweep (every 20 polls of 20 ms)
            assert (await h.client.get(f"/v1/videos/{video_id}")).status_code == 200
            h.clock.now = done["expires_at"]
            for _ in range(100):
                if (await h.client.get(f"/v1/videos/{video_id}")).status_code == 404:
                    break
                await asyncio.sleep(0.05)
            assert (await h.client.get(f"/v1/videos/{video_id}")).json()["error"]["code"] == "video_not_found"
            assert (await h.client.get(f"/v1/videos/{video_id}/content")).status_code == 404
            assert _result_files(tmp_path) == []

    run(scenario())


def test_a_lost_stage_replica_is_retried_once_and_the_rerun_completes(tmp_path):
    async def scenario():
        pipeline = FakePipeline(failures=[ray_errors.ActorDiedError()])
        async with harness(tmp_path, pipeline=pipeline) as h:
            video_id = (await _create(h))["id"]
            assert (await h.wait_for(video_id))["status"] == "completed"
            assert pipeline.calls == [video_id, video_id]
            assert h.service.get(video_id).attempts == 2

    run(scenario())


def test_a_job_whose_replica_is_lost_twice_fails_with_the_reason(tmp_path):
    async def scenario():
        pipeline = FakePipeline(failures=[ray_errors.ActorDiedError(), ray_errors.ActorDiedError()])
        async with harness(tmp_path, pipeline=pipeline) as h:
            video_id = (await _create(h))["id"]
            failed = await h.wait_for(video_id)
            assert failed["status"] == "failed" and failed["error"]["code"] == "retries_exhausted"
            assert "stage replica was lost" in failed["error"]["message"]
            assert len(pipeline.calls) == 2
            assert (await h.client.get(f"/v1/videos/{video_id}/content")).status_code == 409

    run(scenario())


def test_overload_puts_the_job_back_without_using_its_retry(tmp_path):
    async def scenario():
        busy = serve_errors.BackPressureError(num_queued_requests=4, max_queued_requests=4)
        pipeline = FakePipeline(failures=[busy, busy, ray_errors.ActorDiedError()])
        async with harness(tmp_path, pipeline=pipeline) as h:
            video_id = (await _create(h))["id"]
            assert (await h.wait_for(video_id))["status"] == "completed"
            assert len(pipeline.calls) == 4

    run(scenario())


def test_an_unexpected_error_fails_the_job_with_its_message(tmp_path):
    async def scenario():
        async with harness(tmp_path, pipeline=FakePipeline(failures=[RuntimeError("boom")])) as h:
            failed = await h.wait_for((await _create(h))["id"])
            assert failed["error"] == {"code": "generation_failed", "message": "RuntimeError: boom"}

    run(scenario())


def test_a_runner_that_stops_renewing_gives_its_job_back_and_the_rerun_completes(tmp_path):
    async def scenario():
        async with harness(tmp_path) as h:
            # Before the first request this replica's runner has not started: a runner elsewhere
            # claims the job and dies (never renews).
            params = JobParams("a fox", None, 16, 16, 5, 4, 2, 5.0, 1, "1")
            job = h.service.create(new_job(new_job_id(h.clock()), "tiny-wan", params, int(h.clock())))
            assert [j.id for j in h.service.claim("dead-runner", 1)] == [job.id]
            h.clock.now += h.service.jobs.lease_s + 1
            done = await h.wait_for(job.id)
            assert done["status"] == "completed" and h.service.get(job.id).attempts == 2

    run(scenario())


def test_twenty_concurrent_jobs_all_complete_and_list_in_pages_by_creation_time(tmp_path):
    async def scenario():
        async with harness(tmp_path) as h:
            created = await asyncio.gather(*(_create(h, seed=i) for i in range(20)))
            ids = [c["id"] for c in created]
            assert len(set(ids)) == 20
            for video_id in ids:
                assert (await h.wait_for(video_id))["status"] == "completed"
            pages, after = [], None
            while True:
                params = {"limit": 7, "order": "asc", **({"after": after} if after else {})}
                page = (await h.client.get("/v1/videos", params=params)).json()
                pages.append([v["id"] for v in page["data"]])
                after = page["last_id"]
                if not page["has_more"]:
                    break
            assert [len(p) for p in pages] == [7, 7, 6]
            assert sum(pages, []) == sorted(ids)
            newest = (await h.client.get("/v1/videos", params={"limit": 3})).json()["data"]
            assert [v["id"] for v in newest] == sorted(ids)[::-1][:3], "desc (newest first) by default"

    run(scenario())


@pytest.mark.parametrize("query, param", [({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"),
                                          ({"order": "up"}, "order"), ({"after": "../etc"}, "after")])
def test_a_bad_list_query_gets_400_naming_it(tmp_path, query, param):
    async def scenario():
        async with harness(tmp_path) as h:
            response = await h.client.get("/v1/videos", params=query)
            assert response.status_code == 400 and response.json()["error"]["param"] == param

    run(scenario())


def test_unknown_ids_unready_content_and_unknown_variants_get_openai_errors(tmp_path):
    async def scenario():
        async with harness(tmp_path, pipeline=FakePipeline(gate=asyncio.Event())) as h:
            for path in ("/v1/videos/video_000000000000000000000000", "/v1/videos/not-a-video",
                         "/v1/videos/video_000000000000000000000000/content"):
                missing = await h.client.get(path)
                assert missing.status_code == 404 and missing.json()["error"]["code"] == "video_not_found"
            video_id = (await _create(h))["id"]
            early = await h.client.get(f"/v1/videos/{video_id}/content")
            assert early.status_code == 409 and early.json()["error"]["code"] == "video_not_ready"
            sheet = await h.client.get(f"/v1/videos/{video_id}/content", params={"variant": "gif"})
            assert sheet.status_code == 400 and sheet.json()["error"]["param"] == "variant"
            polled = await h.client.get(f"/v1/videos/{video_id}")
            assert polled.headers["openai-poll-after-ms"] == "50"

    run(scenario())


def test_every_videos_route_needs_the_bearer_token(tmp_path):
    async def scenario():
        async with harness(tmp_path, token="secret") as h:
            video_id = (await _create(h))["id"]
            anonymous = {"authorization": ""}
            for method, path in (("POST", "/v1/videos"), ("GET", "/v1/videos"), ("GET", f"/v1/videos/{video_id}"),
                                 ("GET", f"/v1/videos/{video_id}/content"), ("DELETE", f"/v1/videos/{video_id}")):
                response = await h.client.request(method, path, headers=anonymous, json={"prompt": "x"})
                assert response.status_code == 401, (method, path)
            assert (await h.client.get(f"/v1/videos/{video_id}")).status_code == 200

    run(scenario())


def _tiny_decoder_board(room: int) -> FakeBoard:
    """Every stage reported; the decoder's share leaves ``room`` bytes for activations (the tiny Wan
    decoder's calibrated video model: 843 B per pixel + 48.5 B per pixel per frame)."""
    decode = ActivationModel(("n x pixels", "n x pixels x frames"), (843.0, 48.5), 4)
    admission = StageAdmission(PipelineStage.DECODE, room, ((Regime.VIDEO, decode), (Regime.IMAGE, decode)))
    return FakeBoard((ReplicaResidency("fake-decode", "decode", "cpu", "memory", (), 0, 0, 0, {}, admission=admission),))


def test_a_job_no_replica_can_hold_is_refused_at_creation_naming_the_limit(tmp_path):
    async def scenario():
        # 32x16 x 9 frames needs 655,104 B in the decoder; 16x16 x 9 needs 327,552 B.
        async with harness(tmp_path, board=_tiny_decoder_board(600_000)) as h:
            refused = await h.client.post("/v1/videos", json={"prompt": "a cat", "seconds": "2", "size": "32x16"})
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert error["param"] == "seconds" and "decode stage" in error["message"]
            assert "5 frames at this size" in error["message"]
            assert (await h.client.get("/v1/videos")).json()["data"] == [], "a refused job is never stored"
            accepted = await _create(h, seconds="2", size="16x16", fps=4)
            assert (await h.wait_for(accepted["id"]))["status"] == "completed"

    run(scenario())
