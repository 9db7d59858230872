"""LoRA per request in one step batch: requests with adapters X, none and Y share every forward of
the Denoiser replica (built in process from ``tiny_args``: its transformer streamed in memory mode),
and each gets what it gets alone; the request without an adapter gets, bitwise, what the same batch
without any adapter gives it."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from deployments.app import stage_configs
from deployments.models import families
from deployments.replica.batching import BatchingConfig, StepBatch
from deployments.replica.stages import Denoiser
from deployments.wire.spec import GenerationSpec, PipelineStage, RequestRejected, StageOutput, StageStats
from tests.deployments.conftest import tiny_args
from tests.deployments.models.lora_files import write_adapter
from zoo.tiny import ensure_tiny_wan

F32, CPU = torch.float32, torch.device("cpu")
ENCODE, DENOISE = PipelineStage.ENCODE, PipelineStage.DENOISE
# A batch of 3 against a batch of 1 differs by the batched kernels' summation order: < 1e-5 on the
# tiny zoo in fp32 (tests/deployments/replica/test_batching.py), 1e-4 leaves a margin.
ALONE_ATOL = 1e-4
# What an adapter must move a request's latents by at least, so that "equal to alone" means its
# adapter was applied (strength 4 moves them by ~0.5 here).
ADAPTER_EFFECT = 1e-2


def _adapters(folder, strength=4.0) -> list[dict]:
    facts = families.read_family_traits(ensure_tiny_wan())
    plain = families.load_stage_pipeline(facts, DENOISE, F32).transformer
    return [{"name": name, "path": str(write_adapter(plain, folder / f"{name}.safetensors", seed=seed,
                                                     strength=strength)), "families": ["wan"]}
            for name, seed in (("x", 1), ("y", 2))]


def _specs() -> list[GenerationSpec]:
    # Guided (two rows each), n=1 and n=2, different prompts and seeds; one key, so one batch.
    return [GenerationSpec("x", "a red fox", "blurry", 16, 16, 1, 3, 5.0, 1, 1, lora="x", lora_scale=0.8),
            GenerationSpec("none", "a blue bird", None, 16, 16, 1, 3, 3.0, 2, 2),
            GenerationSpec("y", "a green frog", "dark", 16, 16, 1, 3, 4.0, 3, 1, lora="y", lora_scale=1.0)]


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """(Denoiser built in process with adapters x and y, each spec's encoded prompt)."""
    facts = families.read_family_traits(ensure_tiny_wan())
    adapters = _adapters(tmp_path_factory.mktemp("loras"))
    configs = stage_configs(tiny_args(lora_adapters=adapters, lora_device_budget="16MiB"), facts)
    encoder = families.load_stage_pipeline(facts, ENCODE, F32)
    encoded = {s.request_id: families.encode(encoder, facts, s, CPU) for s in _specs()}
    denoiser = Denoiser.func_or_class(configs[DENOISE])
    try:
        yield denoiser, encoded
    finally:
        denoiser.batcher.close()
        denoiser.worker.close()


def _run(denoiser, encoded, specs, streamed: list | None = None, fits=lambda batch: True) -> dict[str, torch.Tensor]:
    """``specs`` joining one batch at its first boundary, on the replica's own stepper and device use;
    ``streamed`` gets each request's share of the weight bytes streamed."""
    batch = StepBatch(denoiser.stepper, BatchingConfig(max_batch=4), fits=fits,
                      bytes_streamed=denoiser.worker.residency.bytes_streamed_so_far)
    requests = [denoiser.stepper.start(encoded[s.request_id], s) for s in specs]
    futures = {r.spec.request_id: batch.submit(r) for r in requests}
    with denoiser.worker.in_use():
        while not batch.idle:
            batch.step()
    if fits(requests):
        assert batch.forwards == max(s.steps for s in specs)  # every forward served all of them
    if streamed is not None:
        streamed.extend(r.bytes_streamed for r in requests)
    return {rid: f.result() for rid, f in futures.items()}


def _without_adapter(spec: GenerationSpec) -> GenerationSpec:
    return dataclasses.replace(spec, lora=None, lora_scale=1.0)


def test_requests_with_adapters_x_none_and_y_share_a_batch_and_each_gets_what_it_gets_alone(replica):
    denoiser, encoded = replica
    specs = _specs()
    mixed = _run(denoiser, encoded, specs)
    base = _run(denoiser, encoded, [_without_adapter(s) for s in specs])
    # None: bitwise what the same batch without any adapter gives it (its rows never see an adapter).
    assert torch.equal(mixed["none"], base["none"])
    for spec in specs:
        alone = _run(denoiser, encoded, [spec])[spec.request_id]
        torch.testing.assert_close(mixed[spec.request_id], alone, rtol=0, atol=ALONE_ATOL)
    for name in ("x", "y"):  # the adapter was applied: far from the base model's latents
        assert (mixed[name] - base[name]).abs().max() > ADAPTER_EFFECT, name


def test_the_replica_streams_the_base_layers_once_per_step_whatever_the_adapters(replica):
    denoiser, encoded = replica
    specs = _specs()
    with_adapters, without = [], []
    _run(denoiser, encoded, specs, with_adapters)
    _run(denoiser, encoded, [_without_adapter(s) for s in specs], without)
    assert with_adapters == without and min(without) > 0  # bytes per request: the same stream


def test_the_adapters_are_standing_device_memory_in_the_lease_and_the_report(replica):
    denoiser, _ = replica
    worker = denoiser.worker
    adapter_bytes = sum(a.nbytes for a in worker.lora_adapters)
    assert worker.lora_bytes == adapter_bytes > 0  # both fit the 16 MiB budget
    assert worker.leases.figures().standing_bytes == worker.residency.kept_bytes() + adapter_bytes
    report = worker.report().to_json()
    assert [(a["name"], a["bytes"], a["place"]) for a in report["loras"]] == [
        (a.name, a.nbytes, "cpu") for a in worker.lora_adapters]


def test_a_request_naming_an_adapter_the_replica_lacks_is_refused_naming_the_field(replica):
    denoiser, encoded = replica

    async def call():
        return [item async for item in denoiser.denoise(_encoded_output(encoded["x"]),
                                                        dataclasses.replace(_specs()[0], lora="z"))]

    with pytest.raises(RequestRejected) as refused:
        asyncio.run(call())
    assert refused.value.param == "lora" and refused.value.status == 404


def _encoded_output(encoded) -> StageOutput:
    return StageOutput(encoded.packed(), StageStats("encode", "test", 0.0, 0, 0))

