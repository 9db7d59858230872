"""Three stage replicas of the tiny Wan share one small GPU: do leases and what they hold stay within it?

Each replica is the service's own StageWorker (its plan against its share, its standing lease,
its calibrated activations, its call reservation), in one process with an in-process ledger of
one GPU pool sized so the encoder's resident token table and a call's activations fill most of
its share. They serve stage calls of mixed shapes at once, from three threads. A sampler thread
adds up what the replicas hold every millisecond: weight bytes on the "device" (their meters)
plus the activation bytes their running calls hold (the live-storage dispatch mode of each call).

Printed by bench/ledger.py: peak of (standing + call leases) over the pool, and peak of what the
replicas held over the pool; both must stay <= 1.0.
"""
from __future__ import annotations

import dataclasses
import random
import threading
import time

import torch

# The encoder's share (half the pool) holds its 32.8 MB resident token table and a call's ~14.7 MB
# of activations (+15 % margin): 110 MB x (1 - the 12 GB profile's 8 % reserve) leaves it ~50 MB.
GPU_BYTES = 110 * 10**6
FRACTIONS = {"encode": 0.5, "denoise": 0.25, "decode": 0.25}
SIZES = ((32, 32, 1, 1), (64, 64, 1, 2), (48, 32, 1, 1), (32, 32, 5, 1), (48, 32, 9, 2))


class _Held:
    """What one replica holds now: its weights on the device and its running call's activation_features."""

    def __init__(self, worker):
        self.worker, self.meter = worker, None

    def bytes_now(self) -> int:
        meter = self.meter
        return self.worker.residency.kept_bytes() + (meter.current if meter is not None else 0)


def _workers(folder):
    from cluster.node import GpuInfo, NodeInfo, probe_host_ram
    from cluster.replica.ledger_view import ReplicaMemory
    from deployments.app import AppArgs, stage_configs
    from deployments.models.families import read_family_traits
    from deployments.replica import worker as stages
    from deployments.wire.spec import PipelineStage

    gpu = GpuInfo(0, "shared-bench-gpu", GPU_BYTES, 4, 16, "bench")
    node = NodeInfo(None, probe_host_ram(), False, (gpu,), None, 0)
    facts = read_family_traits(folder)
    configs = stage_configs(AppArgs(model_path=str(folder)), facts)
    workers = {}
    for stage in PipelineStage:
        # The service opens the node ledger; here one in-process pool stands for the shared GPU.
        stages.open_replica_memory = lambda owner, device, s=stage: ReplicaMemory.open_local(
            owner, device, node=node, gpu_fraction=FRACTIONS[s.value], assigned=(0,))
        stages.replica_id = lambda s, name=stage.value: f"bench-{name}"
        workers[stage] = stages.StageWorker(configs[stage])
    return facts, workers


def _serve(facts, stage, worker, held: _Held, calls: int, seed: int, over: list) -> None:
    from deployments.models import activation_features, families
    from deployments.wire.spec import GenerationSpec
    from offload_core.live_bytes import LiveTensorBytes

    rng = random.Random(seed)
    for i in range(calls):
        w, h, frames, n = rng.choice(SIZES if facts.supports_video else [s for s in SIZES if s[2] == 1])
        spec = GenerationSpec(f"{stage.value}-{i}", "a shared gpu", None, h, w, frames, 1, facts.default_guidance, i, n)
        value = activation_features.stage_input(worker.pipe, facts, stage, spec)
        modules = families.stage_modules(worker.pipe, facts, stage).values()
        with worker.in_use(worker.activation_bytes(spec)):
            leases = worker.leases.figures()
            meter = LiveTensorBytes([t for m in modules for t in (*m.parameters(), *m.buffers())])
            held.meter = meter
            with meter:
                activation_features.run_stage(worker.pipe, facts, stage, spec, worker.device, value)
            held.meter = None
        # The weights' measured peak of the call (the engine's meters) plus its activations' peak.
        peak = worker.residency.device_peak_bytes() + meter.peak
        if peak > leases.standing_bytes + leases.reserved_bytes:
            over.append((stage.value, spec, peak, leases))


def run(calls: int = 12) -> dict:
    from cluster.replica.ledger_view import _LOCAL
    from zoo import tiny

    torch.manual_seed(0)
    facts, workers = _workers(tiny.ensure_tiny_wan())
    pool = _LOCAL["gpu:0"]
    held = {stage: _Held(worker) for stage, worker in workers.items()}
    done, peak_held, over = threading.Event(), [0], []

    def sample():
        while not done.is_set():
            peak_held[0] = max(peak_held[0], sum(h.bytes_now() for h in held.values()))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    threads = [threading.Thread(target=_serve, args=(facts, stage, worker, held[stage], calls, i, over))
               for i, (stage, worker) in enumerate(workers.items())]
    start = time.perf_counter()
    sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    sampler.join()
    seconds = time.perf_counter() - start
    figures = {stage.value: dataclasses.asdict(w.leases.figures()) for stage, w in workers.items()}
    capacity = pool.capacity()
    for worker in workers.values():
        worker.close()
    return {"shared_gpu_pool_bytes": capacity, "shared_gpu_calls": 3 * calls, "shared_gpu_seconds": round(seconds, 2),
            "shared_gpu_lease_peak_over_capacity": round(pool.peak_leased / capacity, 4),
            "shared_gpu_held_peak_over_capacity": round(peak_held[0] / capacity, 4),
            "shared_gpu_calls_holding_more_than_leased": len(over), "shared_gpu_leases": figures}
