"""The plan's working set: one real-size Denoiser forward's activations, measured on the meta device
(offload_core/planner/denoise_activations.py), 15 % over, at least 3 GiB."""
from __future__ import annotations

import json
import math

import pytest
import torch

from offload_core.live_bytes import LiveTensorBytes
from offload_core.planner import denoise_activations as activations
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
    request = activations.DenoiseRequest(64, 96, 5 if pipeline == "WanPipeline" else 1, 5.0, 24)
    inputs = activations.denoise_inputs(pipeline, config, request, torch.float32)
    on_meta = activations.forward_peak(real_models.build_meta(class_name, config, torch.float32), inputs)

    import diffusers

    module = getattr(diffusers, class_name).from_pretrained(folder / "transformer", torch_dtype=torch.float32).eval()
    meter = LiveTensorBytes([*module.parameters(), *module.buffers()])
    cpu_inputs = _on_cpu(inputs)
    with torch.no_grad(), meter:
        module(**cpu_inputs, return_dict=False)
    assert on_meta > 0 and abs(on_meta - meter.peak) <= 0.05 * meter.peak, (pipeline, on_meta, meter.peak)


def test_the_plan_keeps_one_forwards_activations_free_of_weights():
    h100 = gpu_spec("H100")
    facts, notes = real_model_facts("wan2.2-t2v-a14b", h100, 256 * GiB)
    spec = real_models.component_spec("wan2.2-t2v-a14b", "transformer")
    defaults = real_models.pipeline_defaults("wan2.2-t2v-a14b")
    load = {"transformer": (spec.class_name, spec.config, spec.dtype, None),
            "vae": (None, real_models.component_spec("wan2.2-t2v-a14b", "vae").config, None, None)}
    request = activations.denoise_request("WanPipeline", load, defaults)
    peak = activations.denoise_peak("WanPipeline", spec.class_name, spec.config, spec.dtype, request)
    assert peak.bytes > 15 * GiB, "a guided 720p forward over 81 frames: 2 x 75,600 tokens"
    assert facts.working_set_bytes == math.ceil(ACTIVATION_MARGIN * peak.bytes)
    assert any(n.startswith("working set 18.36 GiB: one Denoiser forward at 1280x720x81") for n in notes), notes
    # An image model's forward holds far less than the floor the encoders and the VAE are kept under.
    flux, notes = real_model_facts("flux.1-dev", h100, 64 * GiB)
    assert flux.working_set_bytes == WORKING_SET_FLOOR and any("the floor 3.00 GiB" in n for n in notes)
    given, _ = real_model_facts("wan2.2-t2v-a14b", h100, 256 * GiB, working_set=5 * GiB)
    assert given.working_set_bytes == 5 * GiB


def test_a_forward_meta_cannot_run_keeps_the_floor_and_says_why():
    facts, notes = real_model_facts("hunyuanvideo-1.5-480p-t2v", gpu_spec("L40S"), 64 * GiB)
    assert facts.working_set_bytes == WORKING_SET_FLOOR
    assert any("not measured" in n and "meta" in n for n in notes), notes


def test_every_real_model_has_a_committed_figure_and_one_is_what_measuring_gives_now():
    committed = json.loads(activations.ACTIVATIONS_PATH.read_text())
    assert {entry["model"] for entry in committed["forwards"].values()} == set(real_models.model_names())
    model = "wan2.1-t2v-1.3b"
    spec = real_models.component_spec(model, "transformer")
    load = {c: (s.class_name, s.config, s.dtype, None) for c in ("transformer", "vae")
            for s in [real_models.component_spec(model, c)]}
    request = activations.denoise_request("WanPipeline", load, real_models.pipeline_defaults(model))
    key = activations.forward_key("WanPipeline", spec.class_name, spec.config, spec.dtype, request)
    now = activations.measure("WanPipeline", spec.class_name, spec.config, spec.dtype, request)
    assert committed["forwards"][key]["bytes"] == now.bytes, "run python -m offload_core.planner.denoise_activations"
