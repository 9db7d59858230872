"""What one real-size Denoiser forward and one VAE decode allocate beside their weights, measured on meta.

The plan keeps a working set of the device free of weights for the calls' activations. A fixed 3 GiB was far
off for video: one guided forward of Wan2.1-14B at 832x480x81 holds 6.9 GiB and its VAE's decode 7.6 GiB; a
Wan2.2-A14B expert's 720p forward 16.0 GiB and the decode 17.6 GiB, so a plan that kept 3 GiB called both
experts resident on an 80 GiB card they do not fit. Even the image VAEs' 1024x1024 decodes hold 3.0-3.4 GiB.

:func:`peak_of` runs the component's own call on meta tensors under the meter a replica measures its calls
with on the CPU (offload_core/live_bytes.py: every storage an op creates, until its last tensor dies). No
byte is allocated: a 14B forward at 720p takes about a second. Attention is counted as the fused kernels a
GPU runs it with allocate it (flash / memory-efficient attention: the output and a float32 log-sum-exp per
query, no score matrix), not as the math fallback a meta or CPU tensor would take; a dense mask the model
builds itself is counted, as CUDA allocates it too. :func:`denoise_inputs` gives each pipeline's forward at the
published default request, guidance's branches joined in one forward of twice the rows as the Denoiser runs
them; :func:`decode_latents` one request's latents (n = 1). A call not known here gets no figure (the plan
keeps its floor, and says so).

Runs in whichever process plans: ``offload-serve plan``, ``docs/gen_families.py``.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from offload_core.live_bytes import LiveTensorBytes
from offload_core.planner import real_models
from offload_core.planner.skeletons import library_versions

# The real models' forwards as measured here, for the library versions it records (main() writes it).
ACTIVATIONS_PATH = Path(__file__).resolve().parents[2] / "configs" / "models" / "real_model_activations.json"
# Wan2.1 image-to-video's CLIP ViT-H/14 at 224 x 224: (224 / 14)^2 patches + the class token.
CLIP_IMAGE_TOKENS = 257
# FLUX.1 Kontext's image to edit, fitted to its preferred resolutions (about a megapixel): 1024x1024's packed tokens.
KONTEXT_IMAGE_TOKENS = 4096
# Qwen-Image-Edit's image in the prompt: Qwen2.5-VL's 14 px patches merged 2x2, one token per 28 px square, on
# the image resized to a multiple of 28 within its processor's 1003520 px. The Plus pipeline fits it to 384^2 px
# (CONDITION_IMAGE_SIZE): 392 x 392 -> 14^2 tokens; the first pipeline to 1024^2 px, which the processor caps to
# 980 x 980 -> 35^2 (Qwen2VLImageProcessorPil's image_grid_thw: 28x28 and 70x70 patches).
QWEN_EDIT_PLUS_VISION_TOKENS = 196
QWEN_EDIT_VISION_TOKENS = 1225
# HunyuanVideo 1.5's SigLIP (so400m, 14 px patches) at 384 x 384: 27^2 patches, no class token.
SIGLIP_IMAGE_TOKENS = 729


class _FusedAttention(torch.overrides.TorchFunctionMode):
    """``scaled_dot_product_attention`` as a fused GPU kernel allocates: the output and a float32 log-sum-exp."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, _, v = (*args[:3], *(kwargs[name] for name in ("query", "key", "value")[len(args[:3]):]))
        torch.empty(*q.shape[:-1], dtype=torch.float32, device=q.device)  # the log-sum-exp, dropped at once
        return torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)


def peak_of(call: Callable[[], object], module: nn.Module) -> int:
    """Peak bytes ``call`` (of ``module``, on meta) holds beyond the module's weights and its inputs, no grad."""
    meter = LiveTensorBytes([*module.parameters(), *module.buffers()], device_type="meta")
    with torch.no_grad(), _FusedAttention(), meter:
        call()
    return meter.peak


class Call(str, enum.Enum):
    DENOISE = "denoise"  # one transformer forward (the component "transformer")
    DECODE = "decode"  # one VAE decode of one output's latents (the component "vae")

    @property
    def component(self) -> str:
        return "transformer" if self is Call.DENOISE else "vae"


@dataclass(frozen=True)
class PlannedRequest:
    """The request the calls are measured at: the pipeline's published defaults."""

    height: int
    width: int
    frames: int  # 1 for images
    guidance_scale: float
    text_tokens: int  # the prompt's tokens in the forward: its padded length, or the longest prompt encoded
    vae_spatial: int = 8  # pixels per latent position (16 for Wan2.2's TI2V-5B VAE)
    # The decoder's VAE tiles at its own tile (the service's vae_tiling: deployments/models/vae_tiling.py).
    vae_tiled: bool = False

    def describe(self) -> str:
        frames = f"x{self.frames}" if self.frames > 1 else ""
        tiled = ", VAE tiled" if self.vae_tiled else ""
        return f"{self.width}x{self.height}{frames}, guidance {self.guidance_scale:g}, {self.text_tokens} text tokens{tiled}"


@dataclass(frozen=True)
class CallActivations:
    """One call's activation bytes (None: not measured) and how they were found, or why not."""

    call: Call
    bytes: int | None
    why: str


def planned_request(pipeline: str, load: Mapping[str, tuple], defaults: Mapping[str, Any],
                    vae_tiled: bool = False) -> PlannedRequest:
    """The default request's Denoiser forward as the working set is sized for it: its longest prompt."""
    seq = int(defaults.get("max_sequence_length", 512))
    text = {"StableDiffusion3Pipeline": 77 + seq,  # CLIP's 77 tokens beside T5's
            "QwenImageEditPlusPipeline": seq + QWEN_EDIT_PLUS_VISION_TOKENS,  # the image's vision tokens too
            "QwenImageEditPipeline": seq + QWEN_EDIT_VISION_TOKENS}.get(pipeline, seq)
    vae = load["vae"][1] if "vae" in load else {}
    return PlannedRequest(int(defaults["height"]), int(defaults["width"]), int(defaults.get("num_frames", 1)),
                          float(defaults.get("guidance_scale", 1.0)), text, vae.get("scale_factor_spatial") or 8,
                          vae_tiled)


def _meta(dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    return lambda *shape, dt=dtype: torch.empty(*shape, device="meta", dtype=dt)


def _wan(c, r: PlannedRequest, e, image_tokens: int = CLIP_IMAGE_TOKENS) -> dict:
    rows, frames = (2 if r.guidance_scale > 1.0 else 1), (r.frames - 1) // 4 + 1
    h, w = r.height // r.vae_spatial, r.width // r.vae_spatial
    # TI2V-5B (the only Wan on a 16x VAE) runs with expand_timesteps: a timestep per latent token.
    timestep = e(rows, frames * (h // 2) * (w // 2)) if r.vae_spatial == 16 else e(rows)
    inputs = dict(hidden_states=e(rows, c["in_channels"], frames, h, w), timestep=timestep,
                  encoder_hidden_states=e(rows, r.text_tokens, c["text_dim"]))
    if c.get("image_dim"):  # Wan2.1 I2V: CLIP's 257 hidden states of the reference ride with the text
        inputs["encoder_hidden_states_image"] = e(rows, image_tokens, c["image_dim"])
    return inputs


def _flux(c, r: PlannedRequest, e, context: int = 0) -> dict:
    tokens = (r.height // 16) * (r.width // 16) + context  # guidance is an embedding: one row
    inputs = dict(hidden_states=e(1, tokens, c["in_channels"]), encoder_hidden_states=e(1, r.text_tokens,
                  c["joint_attention_dim"]), pooled_projections=e(1, c["pooled_projection_dim"]), timestep=e(1),
                  img_ids=e(tokens, 3), txt_ids=e(r.text_tokens, 3))
    return inputs | ({"guidance": e(1)} if c.get("guidance_embeds") else {})


def _sd3(c, r: PlannedRequest, e) -> dict:
    rows = 2 if r.guidance_scale > 1.0 else 1
    return dict(hidden_states=e(rows, c["in_channels"], r.height // 8, r.width // 8),
                encoder_hidden_states=e(rows, r.text_tokens, c["joint_attention_dim"]),
                pooled_projections=e(rows, c["pooled_projection_dim"]), timestep=e(rows))


def _z_image(c, r: PlannedRequest, e) -> dict:
    rows = 2 if r.guidance_scale > 0.0 else 1  # Z-Image guides at any scale above 0
    return dict(x=[e(c["in_channels"], 1, r.height // 8, r.width // 8) for _ in range(rows)], t=e(rows),
                cap_feats=[e(r.text_tokens, c["cap_feat_dim"]) for _ in range(rows)])


def _qwen(c, r: PlannedRequest, e, context: int = 0) -> dict:
    rows, h, w = (2 if r.guidance_scale > 1.0 else 1), r.height // 16, r.width // 16
    shapes = [(1, h, w)] + ([(1, 64, 64)] if context else [])  # the edit's image after the output's tokens
    return dict(hidden_states=e(rows, h * w + context, c["in_channels"]),
                encoder_hidden_states=e(rows, r.text_tokens, c["joint_attention_dim"]),
                encoder_hidden_states_mask=None, timestep=e(rows), img_shapes=[shapes] * rows)


def _hunyuan15(c, r: PlannedRequest, e, glyph_tokens: int = 256, image_tokens: int = SIGLIP_IMAGE_TOKENS) -> dict:
    rows, frames = (1 if r.guidance_scale == 1.0 else 2), (r.frames - 1) // 4 + 1
    return dict(hidden_states=e(rows, c["in_channels"], frames, r.height // 16, r.width // 16), timestep=e(rows),
                encoder_hidden_states=e(rows, r.text_tokens, c["text_embed_dim"]),
                encoder_attention_mask=e(rows, r.text_tokens, dt=torch.long),
                encoder_hidden_states_2=e(rows, glyph_tokens, c["text_embed_2_dim"]),
                encoder_attention_mask_2=e(rows, glyph_tokens, dt=torch.long),
                image_embeds=e(rows, image_tokens, c["image_embed_dim"]))


_BUILDERS: dict[str, Callable[..., dict]] = {
    "WanPipeline": _wan, "WanImageToVideoPipeline": _wan, "FluxPipeline": _flux,
    "FluxKontextPipeline": lambda c, r, e: _flux(c, r, e, KONTEXT_IMAGE_TOKENS), "StableDiffusion3Pipeline": _sd3,
    "ZImagePipeline": _z_image, "QwenImagePipeline": _qwen,
    "QwenImageEditPlusPipeline": lambda c, r, e: _qwen(c, r, e, KONTEXT_IMAGE_TOKENS),
    "QwenImageEditPipeline": lambda c, r, e: _qwen(c, r, e, KONTEXT_IMAGE_TOKENS),
    "HunyuanVideo15Pipeline": _hunyuan15, "HunyuanVideo15ImageToVideoPipeline": _hunyuan15,
}


def denoise_inputs(pipeline: str, config: Mapping[str, Any], request: PlannedRequest,
                   dtype: torch.dtype) -> dict | None:
    """The Denoiser's forward inputs for ``pipeline`` at ``request``, on meta; None for a pipeline not known here."""
    builder = _BUILDERS.get(pipeline)
    return None if builder is None else builder(config, request, _meta(dtype))


def decode_latents(class_name: str, config: Mapping[str, Any], request: PlannedRequest,
                   dtype: torch.dtype) -> torch.Tensor | None:
    """One output's final latents as the decoder stage gets them, on meta; None for a VAE not known here."""
    e, frames = _meta(dtype), (request.frames - 1) // 4 + 1  # every video VAE here compresses time 4x
    if class_name == "AutoencoderKL":  # FLUX.1, SD3.5, Z-Image: 8x, images only
        return e(1, config["latent_channels"], request.height // 8, request.width // 8)
    if class_name == "AutoencoderKLQwenImage":  # one frame of Wan's layout
        return e(1, config["z_dim"], 1, request.height // 8, request.width // 8)
    if class_name == "AutoencoderKLWan":
        s = config.get("scale_factor_spatial") or 8
        return e(1, config["z_dim"], frames, request.height // s, request.width // s)
    if class_name == "AutoencoderKLHunyuanVideo15":
        return e(1, config["latent_channels"], frames, request.height // 16, request.width // 16)
    return None


def call_key(call: Call, pipeline: str, class_name: str, config: Mapping[str, Any], dtype: torch.dtype,
             request: PlannedRequest) -> str:
    """What a measurement is a function of, besides the library versions (the committed file records those)."""
    asked = dataclasses.asdict(request)
    # Named only where it changes the call (a tiled decode): a forward's key, and an untiled decode's, stay as
    # they were before the field existed.
    tiled = asked.pop("vae_tiled") and call is Call.DECODE
    if tiled:
        asked["vae_tiled"] = True
    what = json.dumps({"call": call.value, "pipeline": pipeline, "class": class_name, "config": dict(config),
                       "dtype": str(dtype), "request": asked}, sort_keys=True, default=str)
    return hashlib.sha256(what.encode()).hexdigest()[:32]


def measure(call: Call, pipeline: str, class_name: str, config: Mapping[str, Any], dtype: torch.dtype,
            request: PlannedRequest) -> CallActivations:
    """Build the class on meta (importing its library) and count its call at ``request``."""
    if call is Call.DENOISE:
        inputs = denoise_inputs(pipeline, config, request, dtype)
        known = inputs is not None
    else:
        latents = decode_latents(class_name, config, request, dtype)
        known = latents is not None
    if not known:
        return CallActivations(call, None, f"no {call.value} call is known here for {pipeline}'s {class_name}")
    module = real_models.build_meta(class_name, config, dtype)
    if call is Call.DECODE and request.vae_tiled:
        if not hasattr(module, "enable_tiling"):
            return CallActivations(call, None, f"{class_name} has no tiled decode")
        module.enable_tiling()  # at the VAE's own tile, as the service's vae_tiling without vae_tile_px
    run = ((lambda: module(**inputs, return_dict=False)) if call is Call.DENOISE
           else (lambda: module.decode(latents, return_dict=False)))
    try:
        return CallActivations(call, peak_of(run, module), "measured on meta")
    except (RuntimeError, ValueError) as error:
        # HunyuanVideo 1.5 reads its masks' values (meta tensors have none); a folder's small test model may
        # not take its flagship's request (a rotary table shorter than 720p's latent grid).
        return CallActivations(call, None, f"{class_name}'s {call.value} at this request failed on meta: "
                                    f"{type(error).__name__}: {str(error).splitlines()[0]}")


@functools.cache  # read once per process: a plan asks for two calls, the families table for ~150 plans
def _committed() -> dict[str, Any]:
    if not ACTIVATIONS_PATH.is_file():
        return {"libraries": {}, "calls": {}}
    return json.loads(ACTIVATIONS_PATH.read_text())


def planned_peak(call: Call, pipeline: str, class_name: str, config: Mapping[str, Any], dtype: torch.dtype,
                 request: PlannedRequest) -> CallActivations:
    """The committed measurement of this call for the installed libraries, else a measurement now (the real
    models' are committed: planning them imports no library and runs no call, 1-3 s each)."""
    committed = _committed()
    entry = committed["calls"].get(call_key(call, pipeline, class_name, config, dtype, request))
    if entry is not None and committed["libraries"] == library_versions():
        return CallActivations(call, entry["bytes"], entry["why"] if entry["bytes"] is None else "measured on meta, committed")
    return measure(call, pipeline, class_name, config, dtype, request)


def main() -> None:
    """Measure every real model's calls at its default request and commit the figures."""
    calls = {}
    for model in real_models.model_names():
        load = {c: (s.class_name, s.config, s.dtype, s.layer_groups) for c in real_models.component_names(model)
                for s in [real_models.component_spec(model, c)]}
        pipeline = real_models.pipeline_class(model)
        defaults = real_models.pipeline_defaults(model)
        request = planned_request(pipeline, load, defaults)
        # The decode once more with the VAE tiled (the service's vae_tiling), so any plan of a real model reads.
        asked = [(call, request) for call in Call] + [(Call.DECODE, planned_request(pipeline, load, defaults, True))]
        for call, request in asked:
            class_name, config, dtype, _ = load[call.component]
            peak = measure(call, pipeline, class_name, config, dtype, request)
            key = call_key(call, pipeline, class_name, config, dtype, request)
            models = calls.get(key, {}).get("models", [])  # models that share a component and request share it
            calls[key] = {"models": [*models, model], "call": call.value, "request": request.describe(),
                          "bytes": peak.bytes, "why": peak.why}
            shown = "-" if peak.bytes is None else f"{peak.bytes / 2**30:.2f} GiB"
            print(f"{model} {call.value}: {request.describe()}: {shown} ({peak.why})", flush=True)
    ACTIVATIONS_PATH.write_text(json.dumps({
        "generated_by": "python -m offload_core.planner.meta_activations", "libraries": library_versions(),
        "calls": calls}, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
