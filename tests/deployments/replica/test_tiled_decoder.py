"""A decoder replica with ``vae_tiling: on``: it tiles its VAE at the configured tile, calibrates a tiled decode's
two phases at its warm-up, leases a call beyond the tile by them, publishes its tile with its admission (the
ingress's limits predict the same way), and decodes as the pipeline tiled the user's way. In process: the
VaeDecoder class itself on the tiny FLUX.1 folder at its VAE's own tile (the config's sample_size, 32 px: its
calibration takes 4 s where tiny Wan's takes 20)."""
from __future__ import annotations

import asyncio
import logging
import math

import pytest
import torch

from deployments.app import StageArgs, stage_configs
from deployments.capacity.admission import StageAdmission
from deployments.capacity.request_limits import Limits
from deployments.models import activation_features, families, vae_tiling
from deployments.replica.stages import VaeDecoder
from deployments.wire.spec import GenerationSpec, PipelineStage, StageOutput, StageStats
from offload_core.planner.activation_model import ACTIVATION_MARGIN
from tests.deployments.conftest import tiny_args
from zoo import tiny

DECODE = PipelineStage.DECODE
BEYOND = GenerationSpec("beyond", "a fox", None, 64, 96, 1, 2, 3.5, 0, 1)  # 96 px wide: four 32 px tiles


@pytest.fixture(scope="module")
def decoder():
    facts = families.read_family_traits(tiny.ensure_tiny_flux())
    limits = Limits(max_width=320, max_height=320, default_size="16x16", default_steps=2)
    args = tiny_args(limits=limits, tiny_family="flux", decoder=StageArgs(vae_tiling="on"))
    config = stage_configs(args, facts)[DECODE]
    assert config.vae_tiling and config.vae_tile_px is None
    replica = VaeDecoder.func_or_class(config)
    try:
        yield facts, replica
    finally:
        replica.thread.close()
        replica.worker.close()


def test_the_replica_calibrates_both_phases_and_publishes_its_tile(decoder):
    facts, replica = decoder
    worker = replica.worker
    assert vae_tiling.tile_side(worker.pipe.vae) == 32 == worker.activations.tile
    assert set(activation_features.TILED_PHASES[activation_features.Regime.IMAGE]) <= set(worker.activations.models)
    admission = worker.admission()
    assert admission.tile == 32 == worker.report().to_json()["vae_tile_px"], "GET /v1/residency shows the tile"
    untiled = StageAdmission(DECODE, admission.room_bytes, admission.models)
    tiled_need = admission.need_bytes(facts, BEYOND)
    assert tiled_need == worker.activations.predict(BEYOND) < untiled.need_bytes(facts, BEYOND) / 2
    assert worker.activation_bytes(BEYOND) == min(math.ceil(ACTIVATION_MARGIN * tiled_need), worker.activation_room())


def test_the_replica_decodes_beyond_its_tile_as_the_users_tiled_pipeline(decoder):
    facts, replica = decoder
    pipe = families.load_stage_pipeline(facts, DECODE, torch.float32)
    latents = activation_features.stage_input(pipe, facts, DECODE, BEYOND) + 0.5
    untiled = families.decode(pipe, facts, latents, BEYOND, torch.device("cpu"))
    pipe.vae.enable_tiling()  # AutoencoderKL's own tile, as a diffusers user turns it on
    decoded = asyncio.run(replica.decode(StageOutput(latents, StageStats("denoise", "d", 0.0, 0, 0)), BEYOND))
    assert torch.equal(decoded.value, families.decode(pipe, facts, latents, BEYOND, torch.device("cpu")))
    assert not torch.equal(decoded.value, untiled)


def test_the_start_logs_the_tiling_decision(caplog):
    from deployments.replica import worker_setup

    caplog.set_level(logging.INFO)
    facts = families.read_family_traits(tiny.ensure_tiny_wan())
    config = stage_configs(tiny_args(decoder=StageArgs(vae_tiling="on")), facts)[DECODE]
    pipe = worker_setup.load_pipeline(config)
    assert vae_tiling.tile_side(pipe.vae) == 256, "the VAE's own tile"
    assert "decode: the VAE decodes outputs wider or taller than 256 px tile by tile" in caplog.text
