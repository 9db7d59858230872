"""A Denoiser replica reads and checks its LoRA adapters at start: one that does not fit its
transformer fails the start, naming the adapter and the module, before any lease or request; adapters
beyond their device budget are evicted to the host and requests naming them take turns."""
from __future__ import annotations

import pytest
import torch

from deployments.app import stage_configs
from deployments.models import families
from deployments.replica import worker_setup as setup
from deployments.replica.stages import Denoiser
from deployments.wire.spec import PipelineStage
from offload_core.lora import LoraError, load_lora
from tests.deployments.conftest import tiny_args
from tests.deployments.models.lora_files import write_adapter
from tests.deployments.replica.test_lora_batching import ALONE_ATOL, CPU, F32, _adapters, _run, _specs
from zoo.tiny import ensure_tiny_flux, ensure_tiny_wan


def test_an_adapter_written_for_another_transformer_fails_the_replica_start_naming_it_and_the_module(
        workers, tmp_path):
    flux = families.read_family_traits(ensure_tiny_flux())
    other = families.load_stage_pipeline(flux, PipelineStage.DENOISE, torch.float32).transformer
    path = write_adapter(other, tmp_path / "flux-style.safetensors")
    wan = families.read_family_traits(ensure_tiny_wan())
    # Claimed for wan in the config (build_app cannot tell from the file): the replica finds out.
    args = tiny_args(lora_adapters=[{"name": "flux-style", "path": str(path), "families": ["wan"]}])
    with pytest.raises(LoraError, match=r"LoRA adapter 'flux-style' from .* does not fit the wan transformer.*"
                                        r"module '\S+' is not in WanTransformer3DModel"):
        workers(stage_configs(args, wan)[PipelineStage.DENOISE])


def test_adapters_that_do_not_fit_the_budget_together_take_turns_and_the_evicted_one_is_on_the_host(
        tmp_path):
    facts = families.read_family_traits(ensure_tiny_wan())
    encoder = families.load_stage_pipeline(facts, PipelineStage.ENCODE, torch.float32)
    encoded = {s.request_id: families.encode(encoder, facts, s, CPU) for s in _specs()}
    adapters = _adapters(tmp_path)
    one = max(setup.lora_device_bytes((load_lora(a["path"], a["name"]),), F32)[a["name"]] for a in adapters)
    config = stage_configs(tiny_args(lora_adapters=adapters, lora_device_budget=one), facts)[PipelineStage.DENOISE]
    tight = Denoiser.func_or_class(config)
    try:
        # Loaded in order at start: y evicted x (least recently used); the standing lease holds one.
        assert [(a["name"], a["place"]) for a in tight.worker.report().to_json()["loras"]] == [
            ("x", "host"), ("y", "cpu")]
        assert tight.worker.lora_bytes == one
        x, _, y = _specs()
        assert not tight._adapters_fit([tight.stepper.start(encoded["x"], x), tight.stepper.start(encoded["y"], y)])
        together = _run(tight, encoded, [x, y], fits=tight._adapters_fit)  # y joins when x has left
        for spec in (x, y):
            alone = _run(tight, encoded, [spec])[spec.request_id]
            torch.testing.assert_close(together[spec.request_id], alone, rtol=0, atol=ALONE_ATOL)
    finally:
        tight.batcher.close()
        tight.worker.close()
