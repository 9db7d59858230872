"""A component the warm-up did not run: the replica starts, plans it from its meta facts, and times it on first use.

Two cases a request decides: HunyuanVideo 1.5's glyph encoder (only for quoted text) and Wan2.2
A14B's low-noise expert (only after its boundary step). Each: the warm-up leaves it unrun, then a
request that runs it is bitwise the plain pipeline, and the replica's compute for it is measured.
"""
from __future__ import annotations

import logging

import torch

from deployments.app import stage_configs
from deployments.models import families
from deployments.models.hunyuan_video15 import HunyuanVideo15Adapter
from deployments.models.wan import WanAdapter
from deployments.wire.spec import GenerationSpec, PipelineStage
from offload_core.order import declared_layers
from offload_core.planner.facts import streamable_groups
from tests.deployments.conftest import tiny_args
from zoo import tiny_families, wan22

CPU, F32 = torch.device("cpu"), torch.float32
ENCODE, DENOISE, DECODE = PipelineStage.ENCODE, PipelineStage.DENOISE, PipelineStage.DECODE


def _declared(module) -> tuple[str, ...]:
    return tuple(layer.key for layer in declared_layers(module, streamable_groups(module, None)))


def test_the_hunyuan_warmup_quotes_text_so_its_glyph_encoder_is_measured_at_start(workers):
    facts = families.read_family_traits(tiny_families.ensure_tiny_hunyuan15())
    worker = workers(stage_configs(tiny_args(), facts)[ENCODE])
    compute = dict(worker.warmup.compute)
    assert compute["text_encoder_2"].estimated == () and compute["text_encoder_2"].per_use_s > 0
    assert worker.first_use.pending == ()


def test_a_glyph_encoder_the_warmup_never_ran_is_estimated_then_measured_by_the_first_quoting_request(
        workers, monkeypatch, caplog):
    facts = families.read_family_traits(tiny_families.ensure_tiny_hunyuan15())
    monkeypatch.setattr(HunyuanVideo15Adapter, "warmup_prompt", lambda self, facts: "a quiet street")
    caplog.set_level(logging.INFO)
    worker = workers(stage_configs(tiny_args(), facts)[ENCODE])  # used to fail: "the warm-up never ran layers"
    glyph = dict(worker.warmup.compute)["text_encoder_2"]
    keys = _declared(worker.pipe.text_encoder_2)
    assert glyph.estimated == keys and [k for k, _ in glyph.layer_s] == list(keys)
    assert all(s > 0 for _, s in glyph.layer_s), "estimated from parameters at the rate measured on text_encoder"
    assert "text_encoder_2: the warm-up did not run 2 of its 2 layers" in caplog.text
    plan_profile = {p.name: p for p in worker.residency.plan.facts.components}["text_encoder_2"]
    assert plan_profile.compute_s_per_layer == tuple(s for _, s in glyph.layer_s)

    plain = families.load_stage_pipeline(facts, ENCODE, F32)
    for prompt, measured in (("a quiet street", False), ('a sign that reads "HELLO"', True)):
        spec = GenerationSpec("r", prompt, "blurry", 16, 16, 5, 2, facts.default_guidance, 7, 1)
        out = worker.run(lambda: families.encode(worker.pipe, facts, spec, worker.device), spec).value
        expected = families.encode(plain, facts, spec, CPU)
        for got, want in zip((*out.tensors(), *out.negative.tensors()),
                             (*expected.tensors(), *expected.negative.tensors())):
            assert torch.equal(got, want)
        assert worker.first_use.pending == (() if measured else ("text_encoder_2",)), prompt
    glyph = dict(worker.warmup.compute)["text_encoder_2"]
    assert glyph.estimated == () and glyph.per_use_s > 0
    assert "text_encoder_2 measured on first use: 2 layer(s) ran" in caplog.text
    assert "planned again with the compute measured on first use" in caplog.text
    plan_profile = {p.name: p for p in worker.residency.plan.facts.components}["text_encoder_2"]
    assert plan_profile.compute_s_per_layer == tuple(s for _, s in glyph.layer_s)

    # The whole request, from the replica's encoding, is the in-process pipeline's video.
    pipes = {s: families.load_stage_pipeline(facts, s, F32) for s in (DENOISE, DECODE)}
    latents = families.denoise(pipes[DENOISE], facts, out, spec, CPU)
    frames = families.decode(pipes[DECODE], facts, latents, spec, CPU)
    reference = families.reference_frames(families.load_full_pipeline(facts, F32), facts, spec)
    assert torch.equal(frames, reference)


def test_a_second_expert_the_warmup_never_reached_is_estimated_then_measured_after_its_boundary(
        workers, monkeypatch, caplog):
    facts = families.read_family_traits(wan22.ensure_tiny_wan22_a14b())
    monkeypatch.setattr(WanAdapter, "warmup_steps", lambda self, facts: 1)  # 999: the high-noise expert only
    caplog.set_level(logging.INFO)
    worker = workers(stage_configs(tiny_args(), facts)[DENOISE])
    compute = dict(worker.warmup.compute)
    assert compute["transformer"].estimated == ()
    assert compute["transformer_2"].estimated == _declared(worker.pipe.transformer_2)
    assert worker.first_use.pending == ("transformer_2",)

    spec = GenerationSpec("r", "a red fox", "blurry", 16, 16, 5, 4, facts.default_guidance, 3, 1)
    encoded = families.encode(families.load_stage_pipeline(facts, ENCODE, F32), facts, spec, CPU)
    out = worker.run(lambda: families.denoise(worker.pipe, facts, encoded, spec, worker.device), spec).value
    plain = families.denoise(families.load_stage_pipeline(facts, DENOISE, F32), facts, encoded, spec, CPU)
    assert torch.equal(out, plain)
    assert worker.first_use.pending == ()
    assert "transformer_2 measured on first use" in caplog.text
