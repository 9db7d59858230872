"""The plan's working set: the larger of one real-size Denoiser forward's and one VAE decode's activations,
measured on the meta device (offload_core/planner/meta_activations.py), 15 % over, at least 3 GiB."""
from __future__ import annotations

import json
import math

import pytest
import torch

from offload_core.live_bytes import LiveTensorBytes
from offload_core.planner import meta_activations as activations
from offload_core.planner import real_models
from offload_core.planner.activation_model import ACTIVATION_MARGIN
from offload_core.planner.inputs import WORKING_SET_FLOOR, gpu_spec, real_model_facts
from zoo import tiny, tiny_families

GiB = 2**30
ZOO = {"WanPipeline": tiny.ensure_tiny_wan, "FluxPipeline": tiny.ensure_tiny_flux,
       "FluxKontextPipeline": tiny.ensure_tiny_flux_kontext, "StableDiffusion3Pipeline": tiny_families.ensure_tiny_sd3,
       "ZImagePipeline": tiny_families.ensure_tiny_zimage, "QwenImagePipeline": tiny_families.ensure_tiny_qwen_image,
       "QwenImageEditPlusPipeline": tiny_families.ensure_tiny_qwen_image_edit}


def _on_cpu(value):
    """The meta inputs as zeros on the CPU (dicts, lists and tuples kept)."""
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return torch.zeros(value.shape, dtype=value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value


@pytest.mark.parametrize("pipeline", sorted(ZOO))
def test_the_meta_count_is_what_the_cpu_meter_counts_on_the_same_forward(pipeline):
    """The same forward counted twice: on meta (attention as a fused kernel allocates it) and on the CPU, whose
    SDPA runs a fused kernel too (the output and a log-sum-exp). Counted on meta as the math fallback runs it,
    the score matrices made SD3.5's count 1.5x the CPU's and FLUX.1 Kontext's 33x (4,096 image tokens)."""
    folder = ZOO[pipeline]()
    config = {k: v for k, v in json.loads((folder / "transformer" / "config.json").read_text()).items()
              if not k.startswith("_")}
    class_name = json.loads((folder / "model_index.json").read_text())["transformer"][1]
    request = activations.PlannedRequest(64, 96, 5 if pipeline == "WanPipeline" else 1, 5.0, 24)
    inputs = activations.denoise_inputs(pipeline, config, request, torch.float32)
    meta_module = real_models.build_meta(class_name, config, torch.float32)
    on_meta = activations.peak_of(lambda: meta_module(**inputs, return_dict=False), meta_module)

    import diffusers

    module = getattr(diffusers, class_name).from_pretrained(folder / "transformer", torch_dtype=torch.float32).eval()
    meter = LiveTensorBytes([*module.parameters(), *module.buffers()])
    cpu_inputs = _on_cpu(inputs)
    with torch.no_grad(), meter:
        module(**cpu_inputs, return_dict=False)
    assert on_meta > 0 and abs(on_meta - meter.peak) <= 0.05 * meter.peak, (pipeline, on_meta, meter.peak)


VAES = {"AutoencoderKLWan": tiny.ensure_tiny_wan, "AutoencoderKL": tiny.ensure_tiny_flux,
        "AutoencoderKLQwenImage": tiny_families.ensure_tiny_qwen_image,
        "AutoencoderKLHunyuanVideo15": tiny_families.ensure_tiny_hunyuan15}


@pytest.mark.parametrize("class_name", sorted(VAES))
def test_a_decode_counted_on_meta_is_what_the_cpu_meter_counts(class_name):
    import diffusers

    folder = VAES[class_name]()
    config = {k: v for k, v in json.loads((folder / "vae" / "config.json").read_text()).items()
              if not k.startswith("_")}
    request = activations.PlannedRequest(64, 96, 9, 5.0, 24)
    latents = activations.decode_latents(class_name, config, request, torch.float32)
    meta_vae = real_models.build_meta(class_name, config, torch.float32)
    on_meta = activations.peak_of(lambda: meta_vae.decode(latents, return_dict=False), meta_vae)
    vae = getattr(diffusers, class_name).from_pretrained(folder / "vae", torch_dtype=torch.float32).eval()
    meter = LiveTensorBytes([*vae.parameters(), *vae.buffers()])
    with torch.no_grad(), meter:
        vae.decode(_on_cpu(latents), return_dict=False)
    assert on_meta > 0 and abs(on_meta - meter.peak) <= 0.05 * meter.peak, (class_name, on_meta, meter.peak)


@pytest.mark.parametrize("class_name", sorted(VAES))
def test_a_tiled_decode_counted_on_meta_is_what_the_cpu_meter_counts(class_name):
    """The planner's tiled decodes (``vae_tiled``) are counted the same way: 64 px tiles on a 96x128 output."""
    import diffusers

    from deployments.models import vae_tiling

    folder = VAES[class_name]()
    config = {k: v for k, v in json.loads((folder / "vae" / "config.json").read_text()).items()
              if not k.startswith("_")}
    request = activations.PlannedRequest(96, 128, 5, 5.0, 24, vae_tiled=True)
    latents = activations.decode_latents(class_name, config, request, torch.float32)
    meta_vae = real_models.build_meta(class_name, config, torch.float32)
    vae = getattr(diffusers, class_name).from_pretrained(folder / "vae", torch_dtype=torch.float32).eval()
    for module in (meta_vae, vae):
        vae_tiling.enable(module, 64)
    on_meta = activations.peak_of(lambda: meta_vae.decode(latents, return_dict=False), meta_vae)
    meter = LiveTensorBytes([*vae.parameters(), *vae.buffers()])
    with torch.no_grad(), meter:
        vae.decode(_on_cpu(latents), return_dict=False)
    assert on_meta > 0 and abs(on_meta - meter.peak) <= 0.05 * meter.peak, (class_name, on_meta, meter.peak)


def _planned(model: str, call, vae_tiled: bool = False):
    spec = real_models.component_spec(model, call.component)
    load = {c: (s.class_name, s.config, s.dtype, None) for c in ("transformer", "vae")
            for s in [real_models.component_spec(model, c)]}
    request = activations.planned_request(real_models.pipeline_class(model), load, real_models.pipeline_defaults(model),
                                          vae_tiled)
    return spec, request


def test_the_plan_keeps_the_larger_calls_activations_free_of_weights():
    h100, model = gpu_spec("H100"), "wan2.2-t2v-a14b"
    facts, notes = real_model_facts(model, h100, 256 * GiB)
    peaks = {}
    for call in activations.Call:
        spec, request = _planned(model, call)
        peaks[call] = activations.planned_peak(call, "WanPipeline", spec.class_name, spec.config, spec.dtype, request)
    assert peaks[activations.Call.DENOISE].bytes > 15 * GiB, "a guided 720p forward over 81 frames: 2 x 75,600 tokens"
    assert peaks[activations.Call.DECODE].bytes > peaks[activations.Call.DENOISE].bytes, "the VAE's decode binds"
    assert facts.working_set_bytes == math.ceil(ACTIVATION_MARGIN * peaks[activations.Call.DECODE].bytes)
    assert any(n.startswith("working set 20.18 GiB at 1280x720x81") for n in notes), notes
    # A guidance-distilled image model: a small forward, a 3.0 GiB decode, 1.15 x that.
    flux, notes = real_model_facts("flux.1-dev", h100, 64 * GiB)
    assert WORKING_SET_FLOOR < flux.working_set_bytes < 1.2 * WORKING_SET_FLOOR
    given, _ = real_model_facts(model, h100, 256 * GiB, working_set=5 * GiB)
    assert given.working_set_bytes == 5 * GiB


def test_a_call_meta_cannot_run_is_said_in_the_plan():
    facts, notes = real_model_facts("hunyuanvideo-1.5-480p-t2v", gpu_spec("H200"), 64 * GiB)
    note = next(n for n in notes if n.startswith("working set"))
    assert "the denoise call was not measured" in note and "meta" in note, note
    assert facts.working_set_bytes > 80 * GiB, "its untiled 121-frame decode holds 82 GiB"


def test_a_tiled_decode_is_planned_from_its_tiled_count():
    """HunyuanVideo 1.5's 121-frame decode holds 82 GiB untiled; tiled (the service's default for it), 13.6 GiB,
    and the plan keeps 1.15 x that. Wan2.2-A14B's 720p decode tiled falls below its forward, which then binds."""
    h100 = gpu_spec("H100")
    tiled, notes = real_model_facts("hunyuanvideo-1.5-480p-t2v", h100, 64 * GiB, vae_tiled=True)
    untiled, _ = real_model_facts("hunyuanvideo-1.5-480p-t2v", h100, 64 * GiB)
    assert 13 * GiB < tiled.working_set_bytes / ACTIVATION_MARGIN < 14 * GiB < 80 * GiB < untiled.working_set_bytes
    assert any(n.startswith("working set") and "VAE tiled" in n for n in notes), notes
    model = "wan2.2-t2v-a14b"
    peaks = {}
    for tile in (False, True):
        spec, request = _planned(model, activations.Call.DECODE, tile)
        peaks[tile] = activations.planned_peak(activations.Call.DECODE, "WanPipeline", spec.class_name, spec.config,
                                               spec.dtype, request).bytes
    assert peaks[True] < 0.25 * peaks[False]
    spec, request = _planned(model, activations.Call.DENOISE)
    forward = activations.planned_peak(activations.Call.DENOISE, "WanPipeline", spec.class_name, spec.config,
                                       spec.dtype, request).bytes
    facts, _ = real_model_facts(model, h100, 256 * GiB, vae_tiled=True)
    assert peaks[True] < forward and facts.working_set_bytes == math.ceil(ACTIVATION_MARGIN * forward)


def test_every_real_model_has_committed_figures_and_one_is_what_measuring_gives_now():
    committed = json.loads(activations.ACTIVATIONS_PATH.read_text())
    for call in activations.Call:
        assert {m for e in committed["calls"].values() if e["call"] == call.value for m in e["models"]} == set(
            real_models.model_names())
    assert {m for e in committed["calls"].values() if e["request"].endswith("VAE tiled") for m in e["models"]} == set(
        real_models.model_names()), "every model's decode, tiled too"
    model, call = "wan2.1-t2v-1.3b", activations.Call.DENOISE
    spec, request = _planned(model, call)
    key = activations.call_key(call, "WanPipeline", spec.class_name, spec.config, spec.dtype, request)
    now = activations.measure(call, "WanPipeline", spec.class_name, spec.config, spec.dtype, request)
    assert committed["calls"][key]["bytes"] == now.bytes, "run python -m offload_core.planner.meta_activations"
