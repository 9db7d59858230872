"""`make demo`: start Ray and the service from configs/local.yaml, generate one image over HTTP,
edit it (``POST /v1/images/edits``), make one short video through the Videos API's jobs (create,
poll, download) and remix it (``POST /v1/videos/{id}/remix``), save all four, print where every
replica's weights are, and shut everything down.

Ray is started as ``make serve`` starts it (:mod:`deployments.dev.local_ray`: token authentication,
node address 127.0.0.1, dashboard on loopback), then the config is deployed exactly as
``serve run --address auto configs/local.yaml`` deploys it, except that the HTTP port is a free
localhost port (other services on this machine may hold 8000).
"""
from __future__ import annotations

import argparse
import base64
import logging
import os
import pathlib
import socket
import sys
import time

from compat.ray import deploy_config
from deployments.dev import local_ray

for _name, _value in (("RAY_USAGE_STATS_ENABLED", "0"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
    os.environ.setdefault(_name, _value)

logger = logging.getLogger("deployments.dev.demo")

REPO = pathlib.Path(__file__).resolve().parents[2]  # deployments/dev/demo.py -> the repository
OBJECT_STORE_BYTES = local_ray.OBJECT_STORE_BYTES
READY_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_config(path: pathlib.Path, port: int | None):
    """The Serve config file, validated as ``serve run`` validates it; ``port``: the HTTP port instead of the file's."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load(path.read_text())
    if port is not None:
        raw.setdefault("http_options", {})["port"] = port
    return ServeDeploySchema.model_validate(raw)


_FLAGS = {"num_inference_steps": "steps"}  # a request field -> the demo's flag, where the names differ


def request_fault(path: pathlib.Path, prompt: str, size: str, steps: int, seed: int) -> str | None:
    """What the service would refuse in the demo's image request, by the ingress's own checks, or None:
    a size off the model's multiple or too few steps fails here in seconds, not after the minute Ray
    and the replicas take to start. The config's model and limits are read from its args as ``doctor``
    reads them (``model_path``, else the tiny zoo's ``tiny_family``)."""
    import yaml
    from pydantic import ValidationError

    from deployments.api.images.protocol import ImageRequest, image_spec
    from deployments.capacity.request_limits import FieldError, Limits
    from deployments.models.registry import read_family_traits
    from zoo import tiny

    # The file read as yaml, not through Serve's schema: importing Ray here, before main() sets Ray's token
    # environment, left the driver unauthenticated against the head it then started.
    (app,) = yaml.safe_load(path.read_text())["applications"]
    raw = app.get("args") or {}
    zoo = tiny.ensure_tiny_flux if raw.get("tiny_family") == "flux" else tiny.ensure_tiny_wan
    folder = pathlib.Path(raw["model_path"]).expanduser() if raw.get("model_path") else zoo()
    try:
        limits, facts = Limits.model_validate(raw.get("limits", {})), read_family_traits(folder)
    except ValueError:  # a config fault (pydantic's ValidationError is one): the checks that follow name it
        return None
    try:
        request = ImageRequest(prompt=prompt, size=size, num_inference_steps=steps, seed=seed)
        image_spec(request, facts, limits, "demo")
    except FieldError as exc:
        return f"--{_FLAGS.get(exc.param, exc.param)}: {exc.message}"
    except ValidationError as exc:
        first = exc.errors()[0]
        return f"--{_FLAGS.get(str(first['loc'][0]), first['loc'][0])}: {first['msg']}"
    return None


def deploy(config) -> None:
    """What ``serve run <config file>`` does: start Serve with the file's options, deploy its apps."""
    deploy_config(config)


def wait_running(app_name: str) -> None:
    from ray import serve

    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        app = serve.status().applications.get(app_name)
        status = getattr(app, "status", None)
        if status is not None and status.value == "RUNNING":
            return
        if status is not None and status.value in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"application {app_name} {status.value}: {app.message}")
        time.sleep(1)
    raise TimeoutError(f"application {app_name} not running after {READY_TIMEOUT_S} s")


def print_residency(replicas: list[dict]) -> None:
    print("residency report (GET /v1/residency):")
    for replica in sorted(replicas, key=lambda r: r["stage"]):
        print(f"  {replica['stage']:8s} {replica['replica']} on {replica['device']}, mode {replica['mode']}, "
              f"predicted device peak {replica['predicted_peak_bytes']} B, last call streamed "
              f"{replica['last_bytes_streamed']} B")
        for line in replica["plan"][1:]:
            print(f"    plan  {line}")
        for c in replica["weights"]["components"]:
            tiers = ", ".join(f"{n} {tier}" for tier, n in c["layer_tiers"].items())
            print(f"    where {c['name']}: device {c['device_bytes']} B, host pinned {c['host_pinned_bytes']} B, "
                  f"mapped {c['host_mapped_bytes']} B, pageable {c['host_pageable_bytes']} B, parked "
                  f"{c['parked_bytes']} B; streamed layers: {tiers or 'none'}")


def make_video(client, out: pathlib.Path, prompt: str, size: str, steps: int, seed: int) -> str | None:
    """``POST /v1/videos``, poll ``GET /v1/videos/{id}`` until it finishes, download its mp4; its id."""
    return _job(client, "/v1/videos", {"prompt": prompt, "seconds": "1", "size": size, "num_inference_steps": steps,
                                       "seed": seed}, out)


def make_remix(client, video_id: str, out: pathlib.Path, prompt: str) -> str | None:
    """``POST /v1/videos/{id}/remix`` of the finished video toward ``prompt`` (its default strength 0.8)."""
    return _job(client, f"/v1/videos/{video_id}/remix", {"prompt": prompt}, out)


def _job(client, path: str, body: dict, out: pathlib.Path) -> str | None:
    started = time.monotonic()
    created = client.post(path, json=body)
    if created.status_code != 200:
        print(f"video job refused: HTTP {created.status_code} {created.text}", file=sys.stderr)
        return None
    video, seen = created.json(), []
    while video["status"] in ("queued", "in_progress"):
        if not seen or seen[-1] != (video["status"], video["progress"]):
            seen.append((video["status"], video["progress"]))
        time.sleep(0.2)
        video = client.get(f"/v1/videos/{video['id']}").json()
    if video["status"] != "completed":
        print(f"video job {video['id']} {video['status']}: {video['error']}", file=sys.stderr)
        return None
    content = client.get(f"/v1/videos/{video['id']}/content")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(content.content)
    print(f"POST {path} -> {video['id']}: " + ", ".join(f"{status} {pct}%" for status, pct in seen) +
          f", completed; GET /v1/videos/{{id}}/content -> {out} ({len(content.content)} B, {video['seconds']} s, "
          f"{video['size']}) in {time.monotonic() - started:.2f} s")
    return video["id"]


def make_edit(client, image: bytes, out: pathlib.Path, prompt: str, steps: int, seed: int) -> bool:
    """``POST /v1/images/edits`` of ``image`` (multipart, as the official client sends it), saved to ``out``."""
    started = time.monotonic()
    response = client.post("/v1/images/edits", files={"image": ("demo.png", image, "image/png")},
                           data={"prompt": prompt, "num_inference_steps": str(steps), "seed": str(seed),
                                 "strength": "0.6"})
    if response.status_code != 200:
        print(f"edit failed: HTTP {response.status_code} {response.text}", file=sys.stderr)
        return False
    body = response.json()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(base64.b64decode(body["data"][0]["b64_json"]))
    denoised = next(s for s in body["stages"] if s["stage"] == "denoise")
    print(f"POST /v1/images/edits -> {out} ({body['size']}, strength 0.6: {denoised['steps']} of {steps} steps) "
          f"in {time.monotonic() - started:.2f} s")
    return True


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=pathlib.Path, default=REPO / "configs" / "local.yaml")
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "out" / "demo.png")
    parser.add_argument("--edit-out", type=pathlib.Path, default=REPO / "out" / "demo-edit.png")
    parser.add_argument("--video-out", type=pathlib.Path, default=REPO / "out" / "demo.mp4")
    parser.add_argument("--remix-out", type=pathlib.Path, default=REPO / "out" / "demo-remix.mp4")
    parser.add_argument("--prompt", default="a lighthouse on a cliff at dawn")
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    fault = request_fault(args.config, args.prompt, args.size, args.steps, args.seed)  # imports no Ray
    if fault is not None:
        parser.error(fault)  # exit 2, before anything starts
    from deployments.dev import doctor

    # `offload-serve doctor`'s checks first (0.2 s; silent unless something is wrong): a blocker such
    # as a /dev/shm smaller than the object store fails here, not minutes into the start. Before
    # logging is configured, so the checks' own INFO lines (host RAM, fleet profile) stay quiet.
    try:
        if not doctor.preflight(args.config, OBJECT_STORE_BYTES):
            return 1
    except doctor.ConfigError as exc:
        print(f"offload-serve demo: {exc}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    os.environ.update(local_ray.token_env())  # this driver and the head it starts: Ray's token auth
    import httpx
    import ray

    port = _free_port()
    config = load_config(args.config, port)
    (app,) = config.applications
    token_env = (app.args or {}).get("api_token_env")
    headers = {"Authorization": f"Bearer {os.environ[token_env]}"} if token_env else {}
    ray_port = local_ray.free_port()
    head = local_ray.start_head(ray_port, OBJECT_STORE_BYTES, dict(os.environ))
    print(f"Ray head at {local_ray.LOOPBACK}:{ray_port} (token auth, token in {local_ray.token_path(os.environ)})")
    try:
        ray.init(address=f"{local_ray.LOOPBACK}:{ray_port}", namespace="serve", log_to_driver=False)
        started = time.monotonic()
        deploy(config)
        wait_running(app.name)
        print(f"service {app.name} running at http://127.0.0.1:{port}{app.route_prefix} "
              f"after {time.monotonic() - started:.1f} s")
        base = f"http://127.0.0.1:{port}{app.route_prefix.rstrip('/')}"
        with httpx.Client(base_url=base, headers=headers, timeout=300) as client:
            started = time.monotonic()
            response = client.post("/v1/images/generations", json={
                "prompt": args.prompt, "size": args.size, "num_inference_steps": args.steps, "seed": args.seed})
            if response.status_code != 200:
                print(f"request failed: HTTP {response.status_code} {response.text}", file=sys.stderr)
                return 1
            body = response.json()
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_bytes(base64.b64decode(body["data"][0]["b64_json"]))
            print(f"POST /v1/images/generations -> {args.out} ({args.size}, {args.steps} steps, seed "
                  f"{body['seed']}) in {time.monotonic() - started:.2f} s; stages: " +
                  ", ".join(f"{s['stage']} {s['seconds']:.3f} s / {s['bytes_streamed']} B streamed"
                            for s in body["stages"]))
            if not make_edit(client, args.out.read_bytes(), args.edit_out, f"{args.prompt}, in a storm", args.steps,
                             args.seed):
                return 1
            video_id = make_video(client, args.video_out, args.prompt, args.size, args.steps, args.seed)
            if video_id is None or make_remix(client, video_id, args.remix_out, f"{args.prompt}, at night") is None:
                return 1
            print_residency(client.get("/v1/residency").json()["replicas"])
        return 0
    finally:
        # The app deleted, not serve.shutdown(): its controller kills itself under our graceful_shutdown
        # call and Ray prints that task's failure in red after a clean run. The head stops the rest.
        try:
            local_ray.stop_apps([app.name])
        finally:
            local_ray.stop_head(head)


if __name__ == "__main__":
    sys.exit(main())
