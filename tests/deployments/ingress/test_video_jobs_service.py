"""The Videos API on real Ray Serve, driven by the official openai client, on the session's shared
tiny-Wan app (tests/deployments/conftest.py: its video jobs are configured for these tests).

Create, poll, download (the mp4 decodes to the asked frames and size and equals the synchronous
route's bytes), restarts of the ingress and of the job queue mid-job, cancellation freeing the
Denoiser, 20 concurrent jobs, a Denoiser killed mid-job, and a restart of the whole application
(last: each leaves the app running as it found it).
"""
from __future__ import annotations

import concurrent.futures
import io
import pathlib
import re
import time

import httpx
import imageio.v3 as iio
import numpy
import openai
import pytest
import ray
import torch
from PIL import Image

from deployments.jobs.actor import drop_job_queue, queue_name
from deployments.models import families
from deployments.wire import media
from deployments.wire.spec import GenerationSpec
from tests.deployments.conftest import APP, MAX_STEPS, SHARED_LORA, TOKEN, deploy_shared, shared_args
from tests.deployments.ingress.test_service import IMAGES, VIDEOS, replica_name, response_pngs, sse_events
from zoo.tiny import ensure_tiny_wan

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
# Up to 200 steps (the shared app's max_steps) so a job runs long enough (seconds at 64x64, 9 frames)
# to be caught mid-way.
SHORT = {"seed": 1, "num_inference_steps": 2}
LONG = {"seed": 2, "num_inference_steps": 200}
LIMITS = shared_args().limits


@pytest.fixture(scope="module")
def service(service):
    """The shared app's base url."""
    base, _ = service
    return base


@pytest.fixture(scope="module")
def client(service):
    with openai.OpenAI(api_key=TOKEN, base_url=service + "/v1", timeout=120, max_retries=5) as c:
        yield c


def _frames(mp4: bytes):
    assert mp4[4:8] == b"ftyp", f"not an mp4: {len(mp4)} B starting {mp4[:32]!r}"
    return iio.imread(mp4, extension=".mp4", plugin="FFMPEG")


def _wait(client, video_id: str, timeout_s: float = 180):
    deadline = time.monotonic() + timeout_s
    while True:
        video = client.videos.retrieve(video_id)
        if video.status in ("completed", "failed"):
            return video
        assert time.monotonic() < deadline, f"{video_id} still {video.status} at {video.progress}%"
        time.sleep(0.1)


def _wait_progress(client, video_id: str, at_least: int = 1):
    deadline = time.monotonic() + 120
    while (video := client.videos.retrieve(video_id)).progress < at_least:
        assert video.status in ("queued", "in_progress") and time.monotonic() < deadline, video
        time.sleep(0.05)
    return video


def _replica_actor(deployment: str):
    prefix = f"SERVE_REPLICA::{APP}#{deployment}#"
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    return ray.get_actor(name, namespace="serve")


def test_the_openai_client_makes_a_video_of_the_asked_frames_and_size(client, service):
    video = client.videos.create_and_poll(prompt="waves at dusk", seconds="2", size="32x32", poll_interval_ms=100,
                                          extra_body={"fps": 4, "seed": 5, "num_inference_steps": 2})
    assert (video.status, video.progress, video.seconds, video.size) == ("completed", 100, "2", "32x32")
    mp4 = client.videos.download_content(video.id).content
    assert _frames(mp4).shape == (9, 32, 32, 3), "2 s at 4 fps is 9 frames"
    thumbnail = client.videos.download_content(video.id, variant="thumbnail").content
    assert Image.open(io.BytesIO(thumbnail)).size == (32, 32)
    sync = httpx.post(service + "/v1/videos/generations", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120,
                      json={"prompt": "waves at dusk", "size": "32x32", "num_frames": 9, "fps": 4, "seed": 5,
                            "num_inference_steps": 2, "response_format": "mp4"})
    assert sync.content == mp4, "the job and the synchronous shortcut make the same video"
    assert video.id in [v.id for v in client.videos.list(limit=100)]
    assert client.videos.delete(video.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


def test_a_video_job_naming_the_served_adapter_makes_the_synchronous_adapters_video(client, service):
    # The job runner carries the adapter to every stage (JobParams -> the runner's spec); the encoder
    # and the decoder pass it on, the Denoiser applies it.
    body = {"fps": 4, "seed": 6, "num_inference_steps": 2, "lora": SHARED_LORA}
    video = client.videos.create_and_poll(prompt="ink waves", seconds="1", size="32x32", poll_interval_ms=100,
                                          extra_body=body)
    assert video.status == "completed", video
    mp4 = client.videos.download_content(video.id).content
    sync = {"prompt": "ink waves", "size": "32x32", "num_frames": 5, "response_format": "mp4", **body}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    inked = httpx.post(service + VIDEOS, headers=headers, timeout=120, json=sync)
    plain = httpx.post(service + VIDEOS, headers=headers, timeout=120, json={**sync, "lora": None})
    assert inked.content == mp4 and plain.status_code == 200 and plain.content != mp4
    client.videos.delete(video.id)


def readme_examples(heading: str) -> list[str]:
    """The python blocks under the README's ``heading`` (a quickstart subsection), in order."""
    text = (pathlib.Path(__file__).resolve().parents[3] / "README.md").read_text()
    assert heading in text, f"README.md lost its {heading!r} section"
    section = re.split(r"\n##+ ", text.split(heading, 1)[1], maxsplit=1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def readme_example(heading: str) -> str:
    """The one python block under the README's ``heading``."""
    (block,) = readme_examples(heading)
    return block


def test_the_readme_image_examples_run_against_the_service(service, tmp_path, monkeypatch):
    plain, streamed = readme_examples("### An image")  # the plain answer, then the stream with previews
    assert 'base_url="http://127.0.0.1:8000/v1"' in plain and 'api_key="your-token"' in plain
    plain = plain.replace("http://127.0.0.1:8000", service).replace("your-token", TOKEN)
    monkeypatch.chdir(tmp_path)
    exec(compile(plain, "README.md", "exec"), namespace := {"__name__": "readme_image_example"})
    image = (tmp_path / "fox.png").read_bytes()
    assert Image.open(tmp_path / "fox.png").size == (64, 64)
    exec(compile(streamed, "README.md", "exec"), namespace)  # with the first block's client
    assert (tmp_path / "fox.png").read_bytes() == image, "the stream's image is the plain answer's"
    previews = [tmp_path / f"fox-{i}.png" for i in (0, 1)]
    assert all(Image.open(p).size == (64, 64) for p in previews)
    assert len({image, *(p.read_bytes() for p in previews)}) == 3, "two previews, each its own image"
    (edit,) = readme_examples("### An edit")  # on fox.png with the first block's client: 4 of 8 steps run
    exec(compile(edit, "README.md", "exec"), namespace)
    edited = numpy.asarray(Image.open(tmp_path / "fox-snow.png"), dtype=numpy.int16)
    facts = families.read_family_traits(ensure_tiny_wan())
    spec = GenerationSpec("r", "a red fox in the snow", None, 64, 64, 1, 8, facts.default_guidance, 1, 1, image,
                          strength=0.6, edit_rule=facts.edit_rule)
    reference = families.reference_frames(families.load_full_pipeline(facts, torch.float32), facts, spec)
    levels = numpy.abs(edited - (reference[0, 0].numpy() * 255).round()).max()
    assert levels <= 1, f"{levels} 8-bit levels off WanVideoToVideoPipeline (guided: within one, as text-to-video)"


def test_the_readme_client_calls_run_against_the_service(service, tmp_path, monkeypatch):
    code = readme_example("### A video job")  # with the client the first image block makes
    make_client = readme_examples("### An image")[0].split("image = client.images.generate", 1)[0]
    assert 'base_url="http://127.0.0.1:8000/v1"' in make_client and 'api_key="your-token"' in make_client
    make_client = make_client.replace("http://127.0.0.1:8000", service).replace("your-token", TOKEN)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme_video_example"}
    exec(compile(make_client + code, "README.md", "exec"), namespace)
    assert namespace["video"].status == "completed"
    assert _frames((tmp_path / "waves.mp4").read_bytes()).shape == (9, 64, 64, 3)
    assert Image.open(tmp_path / "waves.png").size == (64, 64)
    remix = namespace["remix"]  # 8 - int(8 x 0.8) = 2: steps 3 to 8 of the source's schedule, on its frames
    assert (remix.status, remix.remixed_from_video_id, remix.prompt) == ("completed", namespace["video"].id,
                                                                         "waves at dawn")
    assert _frames((tmp_path / "waves-dawn.mp4").read_bytes()).shape == (9, 64, 64, 3)
    with pytest.raises(openai.NotFoundError):
        namespace["client"].videos.retrieve(namespace["video"].id)
    namespace["client"].videos.delete(remix.id)


def test_a_remix_is_the_video_to_video_pipelines_edit_of_the_finished_videos_frames(client):
    video = client.videos.create_and_poll(prompt="waves at dusk", seconds="1", size="32x32", poll_interval_ms=100,
                                          extra_body={"fps": 4, "seed": 7, "num_inference_steps": 4,
                                                      "guidance_scale": 1.0})
    source = client.videos.download_content(video.id).content
    remix = client.videos.remix(video.id, prompt="waves at dawn", extra_body={"strength": 0.6})
    remix = client.videos.poll(remix.id, poll_interval_ms=100)
    assert (remix.status, remix.remixed_from_video_id) == ("completed", video.id), remix
    facts = families.read_family_traits(ensure_tiny_wan())
    spec = GenerationSpec("r", "waves at dawn", None, 32, 32, 5, 4, 1.0, 7, 1, strength=0.6,
                          edit_rule=facts.edit_rule, reference_video=source)
    reference = families.reference_frames(families.load_full_pipeline(facts, torch.float32), facts, spec)
    # Unguided, the staged edit is the pipeline's bit for bit (test_edits), so its mp4 is the same encode.
    assert client.videos.download_content(remix.id).content == media.mp4_bytes(reference[0], 4)
    for done in (video, remix):
        client.videos.delete(done.id)


def test_the_clients_videos_edit_of_an_uploaded_clip_is_the_pipelines_edit_of_its_frames_scaled(client):
    # 40x40 at 8 fps, 7 frames: edited at its own size rounded down to the model's 16 (32x32), 5 frames.
    clip = media.mp4_bytes(torch.rand(7, 40, 40, 3, generator=torch.Generator().manual_seed(1)), 8)
    edited = client.videos.edit(prompt="waves at dawn", video=("clip.mp4", clip, "video/mp4"),
                                extra_body={"seed": 2, "num_inference_steps": 4, "guidance_scale": 1.0,
                                            "strength": 0.6})
    edited = client.videos.poll(edited.id, poll_interval_ms=100)
    assert (edited.status, edited.size, edited.seconds) == ("completed", "32x32", "0.5"), edited
    facts = families.read_family_traits(ensure_tiny_wan())
    spec = GenerationSpec("r", "waves at dawn", None, 32, 32, 5, 4, 1.0, 2, 1, strength=0.6,
                          edit_rule=facts.edit_rule, reference_video=clip)
    reference = families.reference_frames(families.load_full_pipeline(facts, torch.float32), facts, spec)
    assert client.videos.download_content(edited.id).content == media.mp4_bytes(reference[0], 8)
    client.videos.delete(edited.id)


def test_bad_input_from_the_client_gets_the_openai_error_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.videos.create(prompt="a cat", seconds="12")
    assert (refused.value.param, refused.value.code) == ("seconds", "invalid_value")


def test_a_job_survives_restarts_of_the_ingress_and_the_job_queue_mid_run(client):
    video = client.videos.create(prompt="a lighthouse", size="64x64", seconds="2", extra_body=LONG)
    _wait_progress(client, video.id)
    ray.kill(_replica_actor("Ingress"), no_restart=True)  # Serve starts a new ingress replica
    ray.kill(ray.get_actor(queue_name(APP), namespace="serve"), no_restart=False)  # Ray restarts the queue
    deadline = time.monotonic() + 120
    while True:
        try:
            done = _wait(client, video.id)
            break
        except (openai.APIConnectionError, openai.InternalServerError, openai.APIStatusError):
            assert time.monotonic() < deadline, "the ingress did not come back"
            time.sleep(0.2)
    assert done.status == "completed", done.error
    assert _frames(client.videos.download_content(video.id).content).shape == (9, 64, 64, 3)
    queue = ray.get_actor(queue_name(APP), namespace="serve")
    assert ray.get(queue.get.remote(video.id)).attempts == 2, "rerun from the start once: its one retry"


def _cancel_metrics(ray_cluster) -> dict[str, float]:
    """The Denoiser's cancellation series for this app, scraped from every node's metrics agent: the
    cancels summed over its replicas (the shared app's earlier ones count too), the most steps run after one."""
    found: dict[str, float] = {}
    for node in ray_cluster.list_all_nodes():
        for line in httpx.get(f"http://127.0.0.1:{node.metrics_export_port}/metrics", timeout=10).text.splitlines():
            for name, merge in (("cancelled_requests_total", sum), ("steps_after_cancel", max)):
                if line.startswith(f"ray_offload_serve_{name}{{") and f'application="{APP}"' in line \
                        and 'stage="denoise"' in line:
                    found[name] = merge((found.get(name, 0.0), float(line.rsplit(" ", 1)[1])))
    return found


def test_deleting_a_running_job_stops_the_denoiser_within_a_step(client, ray_cluster):
    before = _cancel_metrics(ray_cluster).get("cancelled_requests_total", 0)
    doomed = client.videos.create(prompt="a storm", size="64x64", seconds="2", extra_body=LONG)
    _wait_progress(client, doomed.id)
    assert client.videos.delete(doomed.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(doomed.id)
    # Workers report every 1 s (tests/conftest.py); a scrape every 0.2 s sees a report within 0.2 s of it.
    deadline, found = time.monotonic() + 90, {}
    while found.get("cancelled_requests_total", 0) < before + 1:
        assert time.monotonic() < deadline, f"the Denoiser reported {found}: the deleted job's call ran on"
        time.sleep(0.2)
        found = _cancel_metrics(ray_cluster)
    assert found["steps_after_cancel"] <= 1
    assert _wait(client, client.videos.create(prompt="calm sea", extra_body=SHORT).id).status == "completed"


def test_twenty_concurrent_jobs_all_complete_and_none_is_lost(client):
    def create(i: int) -> str:
        return client.videos.create(prompt=f"scene {i}", extra_body={**SHORT, "seed": i}).id

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        ids = list(pool.map(create, range(20)))
    assert len(set(ids)) == 20
    done = [_wait(client, video_id, timeout_s=300) for video_id in ids]
    assert [v.status for v in done] == ["completed"] * 20, [v.error for v in done if v.error]
    listed = {v.id for v in client.videos.list(limit=100)}
    assert set(ids) <= listed
    for video_id in ids[:3]:
        assert _frames(client.videos.download_content(video_id).content).shape == (5, 16, 16, 3)


def test_a_denoiser_killed_mid_work_fails_the_request_with_503_reruns_the_job_once_and_is_replaced(client, service):
    """One kill for both callers (each replacement reloads the stage, ~10 s here): a synchronous request
    streaming its steps gets a 503 error event, a video job in the same batch is rerun on the replacement."""
    victim = replica_name("Denoiser")
    headers = {"Authorization": f"Bearer {TOKEN}"}
    body = {"prompt": "after the storm", "seed": 8, "num_inference_steps": 4, "size": "64x64"}
    with httpx.Client(base_url=service, headers=headers, timeout=120) as http:
        expected = response_pngs(http.post(IMAGES, json=body))
        video = client.videos.create(prompt="after the storm", size="64x64", extra_body=LONG)
        _wait_progress(client, video.id)
        # A synchronous video of the job's shape and prompt joins the job's batch (a request of another
        # shape would wait for the job to finish). The kill is sent once its step 1 has been reported:
        # the victim is then denoising both, the job with most of its steps to go.
        long = {"prompt": "after the storm", "seed": 9, "num_inference_steps": MAX_STEPS, "size": "64x64",
                "num_frames": LIMITS.default_frames, "stream": True}
        with http.stream("POST", VIDEOS, json=long) as response:
            events = sse_events(response)
            seen = []
            for name, data in events:
                seen.append((name, data))
                if name == "progress":
                    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
                    break
            seen.extend(events)
        names = [name for name, _ in seen]
        assert names[:2] == ["accepted", "progress"], names
        assert names[-1] == "error", f"the kill did not land mid-request: {names[-3:]}"
        assert set(names[1:-1]) == {"progress"} and names.count("progress") < MAX_STEPS, "the denoiser finished"
        error = seen[-1][1]
        assert (error["status"], error["error"]["code"]) == (503, "replica_unavailable"), error
        done = _wait(client, video.id, timeout_s=240)
        assert done.status == "completed", done.error
        assert _frames(client.videos.download_content(video.id).content).shape == (LIMITS.default_frames, 64, 64, 3)
        queue = ray.get_actor(queue_name(APP), namespace="serve")
        assert ray.get(queue.get.remote(video.id)).attempts == 2, "rerun from the start once: its one retry"
        deadline, later = time.monotonic() + 90, None
        while time.monotonic() < deadline:
            later = http.post(IMAGES, json=body)
            if later.status_code == 200:
                break
            assert later.status_code == 503 and "retry-after" in later.headers, later.text
            time.sleep(0.2)
        assert response_pngs(later) == expected
        replacement = replica_name("Denoiser")
        assert replacement != victim
        listed = {r["replica"] for r in http.get("/v1/residency").json()["replicas"]}
    assert replacement in listed and victim not in listed, "residency must list live replicas only"


def test_jobs_survive_a_restart_of_the_whole_application(client):
    """Last: everything stops (stages, ingress, job queue), as when serve run is stopped, and starts again."""
    from ray import serve

    done = _wait(client, client.videos.create(prompt="before the restart", extra_body=SHORT).id)
    running = client.videos.create(prompt="across the restart", size="64x64", extra_body=LONG)
    _wait_progress(client, running.id)
    serve.delete(APP)
    assert drop_job_queue(APP)
    deploy_shared()
    assert client.videos.retrieve(done.id).status == "completed"
    assert _frames(client.videos.download_content(done.id).content).shape == (5, 16, 16, 3)
    rerun = _wait(client, running.id, timeout_s=240)
    assert rerun.status == "completed", rerun.error
    queue = ray.get_actor(queue_name(APP), namespace="serve")
    assert ray.get(queue.get.remote(running.id)).attempts == 2, "queued again and rerun from the start: its retry"
