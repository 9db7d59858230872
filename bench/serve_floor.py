"""The floor under bench/serve.py's overhead: the service's topology with stages that do nothing.

    python bench/serve_floor.py            # 100 requests per route, interleaved (~1 min on 2 CPUs)

Same Ray Serve path as the service (HTTP proxy -> FastAPI ingress -> encoder -> streaming
denoiser -> decoder, the encoder's answer handed to the denoiser unresolved, the ingress taking the
latents and going on), same payload sizes as the tiny Wan at 32x32 (packed prompt embeddings,
latents, frames), and no model, no engine, no leases. What it costs is what Ray Serve costs on this
machine for that shape of request: the part of the service's overhead no change in this project's
code can remove. Two routes, timed alternately: HTTP alone (proxy and ingress, no stage call) and
the whole chain. Prints a table, then (last line) one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import sys
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from deployments.dev import local_ray  # noqa: E402

local_ray.use_token_auth()  # before Ray is imported: the driver reads its auth mode then

import torch  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from ray import serve  # noqa: E402

# The tiny Wan at 32x32: prompt embeddings packed to the prompt's tokens (2 x 6 x 32 fp32, with
# guidance), latents (1, 16, 1, 4, 4), frames (1, 1, 32, 32, 3).
EMBEDDINGS, LATENTS, FRAMES = (2, 6, 32), (1, 16, 1, 4, 4), (1, 1, 32, 32, 3)


def _payload(shape_or_nbytes) -> torch.Tensor:
    """A tensor of the given shape, or of the given bytes (float32): what a stage hands on."""
    if isinstance(shape_or_nbytes, int):
        return torch.zeros(max(shape_or_nbytes // 4, 1))
    return torch.zeros(shape_or_nbytes)


# Each stage hands on its payload and, like the service's StageStats, when its call started (wall
# clock) and how long it ran, with its input's: the ingress answers the whole timeline (bench/serve.py).
Stamps = tuple  # ((started_at, seconds), ...), in stage order


def _stamped(payload: torch.Tensor, upstream: Stamps = ()) -> tuple[torch.Tensor, Stamps]:
    started_at, start = time.time(), time.perf_counter()
    out = payload.clone()
    return out, (*upstream, (started_at, time.perf_counter() - start))


@serve.deployment(max_ongoing_requests=1)
class NoopEncoder:
    def __init__(self, payload=EMBEDDINGS):
        self.payload = _payload(payload)

    def encode(self, prompt: str) -> tuple[torch.Tensor, Stamps]:
        return _stamped(self.payload)


@serve.deployment(max_ongoing_requests=4)
class NoopDenoiser:
    def __init__(self, payload=LATENTS):
        self.payload = _payload(payload)

    async def denoise(self, encoded: tuple[torch.Tensor, Stamps], steps: int):
        yield _stamped(self.payload, encoded[1])  # the latents alone, as for a request that reads no progress


@serve.deployment(max_ongoing_requests=1)
class NoopDecoder:
    def __init__(self, payload=FRAMES):
        self.payload = _payload(payload)

    def decode(self, latents: tuple[torch.Tensor, Stamps]) -> tuple[torch.Tensor, Stamps]:
        return _stamped(self.payload, latents[1])


api = FastAPI()


@serve.deployment(max_ongoing_requests=64)
@serve.ingress(api)
class FloorIngress:
    def __init__(self, encoder=None, denoiser=None, decoder=None):
        self.encoder, self.denoiser, self.decoder = encoder, denoiser, decoder

    @api.post("/generate")
    async def generate(self, body: dict) -> dict:
        if self.encoder is None:  # the HTTP route: proxy and ingress only
            return {"frames": 0}
        encoded = self.encoder.encode.remote(body["prompt"])
        async for latents in self.denoiser.options(stream=True).denoise.remote(encoded, 2):
            break
        frames, stamps = await self.decoder.decode.remote(latents)
        return {"frames": int(frames.shape[-1]),
                "stages": [{"started_at": at, "seconds": seconds} for at, seconds in stamps]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def floor_app(payloads: tuple = (EMBEDDINGS, LATENTS, FRAMES)):
    """The whole chain with no-op stages handing on ``payloads`` (shapes, or byte counts) in turn."""
    actor = {"num_cpus": 0}
    encoder, denoiser, decoder = (d.options(ray_actor_options=actor).bind(p)
                                  for d, p in zip((NoopEncoder, NoopDenoiser, NoopDecoder), payloads))
    return FloorIngress.options(ray_actor_options=actor).bind(encoder, denoiser, decoder)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100, help="per route, after 5 warm-up requests")
    args = parser.parse_args(argv)

    import httpx
    import ray

    local_ray.init_local(include_dashboard=False, object_store_memory=200 * 1024 * 1024, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    actor = {"num_cpus": 0}
    try:
        serve.run(FloorIngress.options(ray_actor_options=actor).bind(), name="floor-http", route_prefix="/http")
        serve.run(floor_app(), name="floor-chain", route_prefix="/chain")
        routes = {"http": "/http/generate", "chain": "/chain/generate"}
        times: dict[str, list[float]] = {name: [] for name in routes}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            for i in range(5 + args.requests):
                for name, path in (routes.items() if i % 2 == 0 else reversed(routes.items())):
                    start = time.perf_counter()
                    response = client.post(path, json={"prompt": "a lighthouse at dawn"})
                    assert response.status_code == 200, response.text
                    if i >= 5:
                        times[name].append(time.perf_counter() - start)
    finally:
        serve.shutdown()
        ray.shutdown()

    load = os.getloadavg()[0]
    print(f"Ray Serve floor, {args.requests} requests per route, load average {load:.2f}")
    print(f"{'route':44s} {'median ms':>10s} {'p25 ms':>8s} {'min ms':>8s}")
    labels = {"http": "HTTP: proxy + ingress, no stage call", "chain": "HTTP + encoder + denoiser + decoder"}
    result = {"bench": "serve_floor", "requests": args.requests, "load_average": round(load, 2)}
    for name, values in times.items():
        median, p25, low = statistics.median(values), statistics.quantiles(values, n=4)[0], min(values)
        print(f"{labels[name]:44s} {median * 1e3:10.2f} {p25 * 1e3:8.2f} {low * 1e3:8.2f}")
        result[f"{name}_ms"] = round(median * 1e3, 2)
        result[f"{name}_min_ms"] = round(low * 1e3, 2)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
