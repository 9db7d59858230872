"""A Denoiser at tp_size 2: the step batcher in this process, the DiT's forwards on 2 gloo ranks (FLUX.1 and
Qwen-Image, the families whose transformer diffusers ships a ``_tp_plan`` for).

Each rank is a spawned process with the StageWorker a rank actor holds (its slice of the DiT, its plan,
leases and warm-up); the group here hands every call to both ranks in one order and answers rank 0's
output, as ``ShardGroup`` does over Ray. The batched requests' latents equal tp_size 1's within 1e-5.
"""
from __future__ import annotations

import dataclasses
import datetime
import socket

import pytest
import torch

from deployments.app import StageArgs, stage_configs
from deployments.models import families
from deployments.models.steppers import stepper_for
from deployments.models.tensor_parallel import check_tp
from deployments.replica.batching import BatchingConfig, StepBatch
from deployments.replica.rank_spec import RankSpec
from deployments.replica.tensor_parallel.ranked_denoiser import (
    RankedStageWorker,
    StepCacheAtTensorParallel,
    refuse_cached_request,
    refuse_step_cache,
)
from deployments.wire.spec import GenerationSpec, PipelineStage, RequestRejected
from offload_core.planner.search import PerformanceMode
from tests import ranks
from tests.deployments.conftest import tiny_args
from zoo.tiny import ensure_tiny_flux
from zoo.tiny_families import ensure_tiny_qwen_image

F32, CPU = torch.float32, torch.device("cpu")
# fp32 over 2 ranks: the row-parallel layers' all-reduce sums two partial products in another order.
TP_ATOL = 1e-5
SPECS = [GenerationSpec("a", "a lighthouse", None, 16, 16, 1, 3, 3.5, 1, 1),
         GenerationSpec("b", "a harbour", None, 16, 16, 1, 2, 2.0, 2, 1)]


def _config(facts):
    # As the service's tiny denoiser: every layer streamed (the engine runs on each rank's slice).
    args = tiny_args(denoiser=StageArgs(tp_size=2, offload_mode=PerformanceMode.MEMORY, host_memory_budget="64MiB"))
    return stage_configs(args, facts)[PipelineStage.DENOISE]


def _rank(rank: int, port: int, folder: str, inbox, outbox) -> None:
    from deployments.replica.worker import StageWorker

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                         timeout=datetime.timedelta(seconds=60))
    worker = StageWorker(_config(families.read_family_traits(folder)), rank=RankSpec(rank, 2, "tp-denoise-test"))
    try:
        while (item := inbox.get()) is not None:
            fn, args = item
            result = fn(worker, *args)
            outbox.put(result if rank == 0 else None)
    finally:
        worker.close()
        torch.distributed.destroy_process_group()


class _SpawnedGroup:
    """Two rank processes, called as ShardGroup calls its rank actors: every call to all, rank 0's answer."""

    def __init__(self, folder: str):
        ctx = ranks.context()
        self.inboxes, self.outboxes = [ctx.Queue() for _ in range(2)], [ctx.Queue() for _ in range(2)]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.ranks = [ctx.Process(target=_rank, args=(r, port, folder, self.inboxes[r], self.outboxes[r]))
                      for r in range(2)]
        for p in self.ranks:
            p.start()
        self.calls = 0

    def call(self, fn, *args):
        self.calls += 1
        for inbox in self.inboxes:
            inbox.put((fn, args))
        return [outbox.get(timeout=300) for outbox in self.outboxes][0]

    def reports(self):
        raise AssertionError("not asked in this test")

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.ranks:
            p.join(timeout=60)
            assert p.exitcode == 0, p.exitcode


def _run(stepper, encoded, bytes_streamed=lambda: 0):
    """Request a joins before the first forward, b before the second; each one's latents."""
    batch = StepBatch(stepper, BatchingConfig(max_batch=4), bytes_streamed=bytes_streamed)
    futures = {SPECS[0].request_id: batch.submit(stepper.start(encoded[0], SPECS[0]))}
    batch.step()
    futures[SPECS[1].request_id] = batch.submit(stepper.start(encoded[1], SPECS[1]))
    while not batch.idle:
        batch.step()
    return {rid: f.result() for rid, f in futures.items()}, batch


TP_FAMILIES = {"flux": ensure_tiny_flux, "qwen-image": ensure_tiny_qwen_image}


@pytest.mark.parametrize("family", sorted(TP_FAMILIES))
def test_the_batched_denoiser_over_2_gloo_ranks_answers_what_tp_size_1_does(family):
    folder = str(TP_FAMILIES[family]())
    facts = families.read_family_traits(folder)
    encoder = families.load_stage_pipeline(facts, PipelineStage.ENCODE, F32)
    encoded = [families.encode(encoder, facts, s, CPU) for s in SPECS]
    plain = families.load_stage_pipeline(facts, PipelineStage.DENOISE, F32)
    want, plain_batch = _run(stepper_for(plain, facts, CPU), encoded)

    group = _SpawnedGroup(folder)
    try:
        ranked = RankedStageWorker(_config(facts), group, "tp-denoise-test")
        assert not isinstance(ranked.pipe.transformer, torch.nn.Module)  # no weights in the replica
        with ranked.in_use(ranked.activation_bytes(SPECS[0], 4)):
            got, batch = _run(stepper_for(ranked.pipe, facts, CPU), encoded, ranked.bytes_streamed_so_far)
    finally:
        group.close()
    # a: 3 steps, b: 2 steps joining at the second boundary: 3 forwards, each one fan-out to both ranks.
    assert batch.forwards == plain_batch.forwards == 3 and batch.request_steps == 5
    assert group.calls == 1 + 3  # the activation size, then one call per forward
    diff = max((got[s.request_id] - want[s.request_id]).abs().max().item() for s in SPECS)
    print(f"{family}: tp 2 vs tp 1 latents: max |difference| {diff:.3g}")
    assert diff <= TP_ATOL, diff
    assert ranked.bytes_streamed_so_far() > 0  # rank 0 streamed its slice's layers (MEMORY mode)


def test_the_flux_denoiser_accepts_tp_2_at_deploy_and_refuses_the_step_cache_there():
    facts = families.read_family_traits(ensure_tiny_flux())
    check_tp(facts, PipelineStage.DENOISE, 2)
    config = _config(facts)
    with pytest.raises(StepCacheAtTensorParallel, match=r"cache_threshold 0.1 for the denoise stage at tp_size 2"):
        refuse_step_cache(dataclasses.replace(config, cache_threshold=0.1))
    with pytest.raises(RequestRejected, match=r"over 2 tensor-parallel ranks, where the step cache does not run"):
        refuse_cached_request(config, dataclasses.replace(SPECS[0], cache_threshold=0.2))
    refuse_cached_request(dataclasses.replace(config, tp_size=1), dataclasses.replace(SPECS[0], cache_threshold=0.2))
