"""LoRA per request in a step batch: 4 requests with 4 different adapters vs 4 without, one stream.

The medium Wan denoiser in memory mode (every layer streamed, depth 1), stepped as the Denoiser
replica steps it (``StepBatch``; the adapters through ``LoraStepper`` over ``offload_core.lora``'s
``LoraSet``): rounds alternate a batch of 4 requests without adapters and a batch of 4 requests
each naming another adapter (random A/B, rank ``--rank``, on every attention and feed-forward
Linear), all 4 joining at the first boundary, in alternating order. Figures: the step (forward) time ratio, the bytes
streamed per request ratio (adapters stay on the device: the base layer streams once per step for
all), the adapters' device bytes, and a projection at real size: FLUX.1-dev at 1024x1024, rank 64
on the same Linears, the low-rank term's FLOPs over the step's (from
/work/shared/real_model_configs.json, counted analytically: no weights).

    .venv/bin/python bench/lora.py --quick

Last line: one JSON object with ``step_ratio_4_adapters`` (target <= 1.15 on CPU) and
``bytes_per_request_ratio`` (target == 1.0); exit 1 on a miss (bench/checks.py).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from checks import at_most, equal, finish  # noqa: E402

from deployments.models import families  # noqa: E402
from deployments.models.lora_rows import LoraStepper  # noqa: E402
from deployments.models.steppers import stepper_for  # noqa: E402
from deployments.replica.batching import BatchingConfig, StepBatch  # noqa: E402
from deployments.wire.spec import GenerationSpec, PipelineStage  # noqa: E402
from offload_core import StreamingConfig, apply_layer_streaming  # noqa: E402
from offload_core.lora import apply_lora, load_lora  # noqa: E402
from tests.deployments.models.lora_files import target_linears, write_adapter  # noqa: E402
from zoo.tiny import ensure_medium_wan  # noqa: E402

CPU = torch.device("cpu")
CLIENTS = 4
REAL_CONFIGS = Path("/work/shared/real_model_configs.json")


def run_batch(stepper, batch_config, encoded, specs) -> tuple[list[float], list[float]]:
    """All of ``specs`` join at the first boundary; (each forward's seconds, each request's bytes streamed)."""
    forwards: list[float] = []
    batch = StepBatch(stepper, batch_config, clock=time.perf_counter,
                      on_forward=lambda figures: forwards.append(figures.seconds), bytes_streamed=stepper.bytes)
    requests = [stepper.start(encoded, spec) for spec in specs]
    for request in requests:
        batch.submit(request)
    while not batch.idle:
        batch.step()
    return forwards, [r.bytes_streamed for r in requests]


class _Counted(LoraStepper):
    """The service's LoRA stepper, with the streamer's byte counter for StepBatch."""

    def __init__(self, inner, loras, streamer):
        super().__init__(inner, loras)
        self.bytes = lambda: streamer.bytes_copied


def specs_for(steps: int, adapters: list[str | None], round_: int) -> list[GenerationSpec]:
    return [GenerationSpec(f"r{round_}-c{c}", "a red fox", None, 16, 16, 1, steps, 5.0, 100 * round_ + c, 1,
                           lora=name, lora_scale=1.0)
            for c, name in enumerate(adapters)]


def flux_projection(rank: int) -> dict:
    """FLUX.1-dev at 1024x1024 (4096 image + 512 text tokens), one guided-distilled forward: the
    Linear and attention FLOPs of the step, and a rank-``rank`` adapter's low-rank FLOPs on the
    attention and feed-forward Linears (2 * tokens * rank * (in + out) each)."""
    config = json.loads(REAL_CONFIGS.read_text())["flux.1-dev"]
    cfg, pipe = config["transformer"]["config"], config["pipeline_defaults"]
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    image = (pipe["height"] // 16) * (pipe["width"] // 16)
    text = pipe["max_sequence_length"]
    seq = image + text
    mlp = 4 * dim
    # (tokens, in, out) of each adapted Linear: a double block's image and text streams, a single block's.
    double = [(t, dim, dim) for t in (image, text) for _ in range(4)] + [(t, dim, mlp) for t in (image, text)] + \
             [(t, mlp, dim) for t in (image, text)]
    single = [(seq, dim, dim)] * 3 + [(seq, dim, mlp), (seq, dim + mlp, dim)]
    linears = double * cfg["num_layers"] + single * cfg["num_single_layers"]
    base = sum(2 * t * i * o for t, i, o in linears)
    attention = 4 * seq * seq * dim * (cfg["num_layers"] + cfg["num_single_layers"])  # QK^T and AV
    low_rank = sum(2 * t * rank * (i + o) for t, i, o in linears)
    adapter_bytes = sum(rank * (i + o) for _, i, o in linears) * 2  # bf16
    return {"model": "flux.1-dev", "tokens": seq, "rank": rank, "step_gflops": round((base + attention) / 1e9, 1),
            "low_rank_gflops": round(low_rank / 1e9, 1), "low_rank_flops_fraction": round(low_rank / (base + attention), 4),
            "adapter_bytes_bf16": adapter_bytes}


def adapters_for(transformer, rank: int) -> list:
    """CLIENTS random adapters at ``rank`` on the transformer's attention and feed-forward Linears, read
    into host memory (their files are gone when this returns)."""
    folder = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    try:
        return [load_lora(str(write_adapter(transformer, folder / f"style-{c}.safetensors", rank=rank, seed=c)),
                          f"style-{c}") for c in range(CLIENTS)]
    finally:
        shutil.rmtree(folder)


def measure(rank: int, rounds: int, steps: int) -> dict:
    """Rounds alternating 4 requests without adapters and 4 with 4 different ones: the figures."""
    facts = families.read_family_traits(ensure_medium_wan())
    encoder = families.load_stage_pipeline(facts, PipelineStage.ENCODE, torch.float32)
    pipe = families.load_stage_pipeline(facts, PipelineStage.DENOISE, torch.float32)
    encoded = families.encode(encoder, facts, specs_for(steps, [None], 0)[0], CPU)
    adapters = adapters_for(pipe.transformer, rank)
    names = [a.name for a in adapters]
    streamer = apply_layer_streaming(pipe.transformer, CPU, StreamingConfig(prefetch_depth=1))
    loras = apply_lora(pipe.transformer, CPU, sum(a.nbytes for a in adapters))
    for adapter in adapters:
        loras.load(adapter)
    stepper, config = _Counted(stepper_for(pipe, facts, CPU), loras, streamer), BatchingConfig(max_batch=CLIENTS)
    times: dict[str, list[float]] = {"base": [], "adapters": []}
    per_request: dict[str, list[float]] = {"base": [], "adapters": []}
    try:
        run_batch(stepper, config, encoded, specs_for(steps, names, 0))  # warm both paths once
        for r in range(1, rounds + 1):
            kinds = (("base", [None] * CLIENTS), ("adapters", names))
            for kind, chosen in kinds if r % 2 else kinds[::-1]:  # either order as often: drift cancels
                forwards, streamed = run_batch(stepper, config, encoded, specs_for(steps, chosen, r))
                times[kind] += forwards
                per_request[kind] += streamed
    finally:
        streamer.remove()
    step = {k: statistics.median(v) for k, v in times.items()}
    bytes_per = {k: statistics.mean(v) for k, v in per_request.items()}
    loaded = loras.loaded()
    return {
        "bench": "lora", "model": "medium-wan", "clients": CLIENTS, "rank": rank, "steps": steps, "rounds": rounds,
        "layers_streamed": len(streamer.layers), "linears_adapted": len(target_linears(pipe.transformer)),
        "step_s_base": round(step["base"], 5), "step_s_4_adapters": round(step["adapters"], 5),
        "step_ratio_4_adapters": round(step["adapters"] / step["base"], 4),
        "bytes_per_request_base": int(bytes_per["base"]), "bytes_per_request_4_adapters": int(bytes_per["adapters"]),
        "bytes_per_request_ratio": round(bytes_per["adapters"] / bytes_per["base"], 4),
        "adapter_device_bytes": sum(a.nbytes for a in loaded), "adapters_loaded": len(loaded),
        "projection": flux_projection(64)}


def print_figures(r: dict) -> None:
    projection = r["projection"]
    print(f"medium Wan denoiser, memory mode ({r['layers_streamed']} layers streamed, depth 1), {r['clients']} "
          f"requests per batch, {r['steps']} steps, guided, {r['rounds']} rounds each; {r['linears_adapted']} "
          f"Linears adapted at rank {r['rank']}")
    print(f"step: {r['step_s_base'] * 1e3:.2f} ms without adapters, {r['step_s_4_adapters'] * 1e3:.2f} ms with "
          f"4 different adapters: {r['step_ratio_4_adapters']:.3f}x")
    print(f"bytes streamed per request: {r['bytes_per_request_base']:,} vs {r['bytes_per_request_4_adapters']:,} "
          f"({r['bytes_per_request_ratio']:.4f}x)")
    print(f"adapters on the device: {r['adapters_loaded']}, {r['adapter_device_bytes']:,} B")
    print(f"projection, FLUX.1-dev 1024x1024 rank 64: low-rank {projection['low_rank_gflops']} GFLOP of "
          f"{projection['step_gflops']} GFLOP per forward ({projection['low_rank_flops_fraction']:.2%}); "
          f"adapter {projection['adapter_bytes_bf16'] / 2**20:.0f} MiB in bf16")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 rounds of each, 4 steps")
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds, steps = (4, 4) if args.quick else (8, 8)
    result = measure(args.rank, rounds, steps)
    print_figures(result)
    return finish(result, [at_most("step_ratio_4_adapters", result["step_ratio_4_adapters"], 1.15),
                           equal("bytes_per_request_ratio", result["bytes_per_request_ratio"], 1.0)])


if __name__ == "__main__":
    sys.exit(main())
