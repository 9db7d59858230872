"""Pipeline facts for the plan CLI: real-size models on the meta device, or a local diffusers folder.

Shapes and dtypes are all the byte figures need, so components are built under
``torch.device("meta")`` (by :mod:`offload_core.planner.real_models`) from published configs
(configs/models/real_model_configs.json) or from a folder's own config files
(:mod:`offload_core.planner.folders`): a 14B model plans on a laptop.

Uses per request and tokens per use follow the pipelines' defaults; per-layer compute is
estimated from FLOPs at a sustained fraction of the GPU's dense BF16 rate.

Runs in whichever process plans: ``offload-serve plan`` and each stage replica (through ``cluster/replica/plan.py``).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

from offload_core.host.ram import default_reserve
from offload_core.layout import (
    LayoutError,
    declared_layer_groups,
    resolve_layer_group,
)
from offload_core.planner import facts_cache, gpus, meta_activations, real_models, skeletons
from offload_core.planner.activation_model import ACTIVATION_MARGIN
from offload_core.planner.facts import (
    ComponentProfile,
    LinkFacts,
    PipelineFacts,
    Stage,
    profile_component,
    with_compute,
)
from offload_core.planner.flow_timesteps import high_noise_steps, min_steps
from offload_core.planner.meta_activations import (
    CLIP_IMAGE_TOKENS,
    KONTEXT_IMAGE_TOKENS,
    QWEN_EDIT_PLUS_VISION_TOKENS,
    QWEN_EDIT_VISION_TOKENS,
    SIGLIP_IMAGE_TOKENS,
    Call,
    planned_request,
)
from offload_core.tables import HostTablesConfig
from offload_core.tensor_parallel.plans import (
    check_heads_divide,
    classes_with_plans,
    has_plan,
    planning_world,
    shard_planned,
)
from offload_core.tensor_parallel.sharded import local_nbytes, sharded_parameters

logger = logging.getLogger(__name__)

GiB = 1024**3
# The working set never below 3 GiB: the encoders' calls are not measured here, and 3 GiB was the fixed figure
# before the Denoiser's forward and the VAE's decode were (the image models' hold 0.45-1.51 and 3.0-3.4 GiB).
WORKING_SET_FLOOR = 3 * GiB
# Diffusion transformers sustain ~40 % of peak in practice (attention, norms, launch gaps).
SUSTAINED_FRACTION = 0.4
STAGES = {
    "WanPipeline": (Stage("encode", ("text_encoder",)), Stage("denoise", ("transformer",)), Stage("decode", ("vae",))),
    # Wan2.2 I2V-A14B's layout (no image encoder): the VAE also encodes the reference image, in the decoder stage.
    "WanImageToVideoPipeline": (Stage("encode", ("text_encoder",)), Stage("denoise", ("transformer",)),
                                Stage("decode", ("vae",))),
    "FluxPipeline": (Stage("encode", ("text_encoder", "text_encoder_2")), Stage("denoise", ("transformer",)),
                     Stage("decode", ("vae",))),
    # FLUX.1 Kontext: FLUX.1's stages; the VAE also encodes the image to edit, in the decoder stage.
    "FluxKontextPipeline": (Stage("encode", ("text_encoder", "text_encoder_2")), Stage("denoise", ("transformer",)),
                            Stage("decode", ("vae",))),
    "StableDiffusion3Pipeline": (Stage("encode", ("text_encoder", "text_encoder_2", "text_encoder_3")),
                                 Stage("denoise", ("transformer",)), Stage("decode", ("vae",))),
    "ZImagePipeline": (Stage("encode", ("text_encoder",)), Stage("denoise", ("transformer",)), Stage("decode", ("vae",))),
    "QwenImagePipeline": (Stage("encode", ("text_encoder",)), Stage("denoise", ("transformer",)),
                          Stage("decode", ("vae",))),
    # Qwen-Image-Edit (-2509/-2511 and the first): Qwen-Image's stages; the text encoder's vision tower sees the
    # image, the VAE also encodes it, in the decoder stage.
    "QwenImageEditPlusPipeline": (Stage("encode", ("text_encoder",)), Stage("denoise", ("transformer",)),
                                  Stage("decode", ("vae",))),
    "QwenImageEditPipeline": (Stage("encode", ("text_encoder",)), Stage("denoise", ("transformer",)),
                              Stage("decode", ("vae",))),
    "HunyuanVideo15Pipeline": (Stage("encode", ("text_encoder", "text_encoder_2")), Stage("denoise", ("transformer",)),
                               Stage("decode", ("vae",))),
    # Its image-to-video: the SigLIP image encoder joins the encode stage (pipeline_stages), the VAE also
    # encodes the reference image.
    "HunyuanVideo15ImageToVideoPipeline": (Stage("encode", ("text_encoder", "text_encoder_2")),
                                           Stage("denoise", ("transformer",)), Stage("decode", ("vae",))),
}
# Z-Image and Qwen-Image feed the transformer the prompt's own tokens (no padding): a typical prompt
# after their chat templates, for compute estimates only.
PROMPT_TOKENS = 128


@dataclass(frozen=True)
class GpuSpec:
    """What the CLI knows of a GPU model: memory, link bandwidth, compute rate."""

    name: str
    memory_bytes: int
    pinned_Bps: float
    flops: float  # sustained FLOP/s used for compute estimates


def gpu_spec(name: str) -> GpuSpec:
    """The GPU table's facts plus the sustained compute rate the planner's time estimates use."""
    try:
        model = gpus.gpu_model(name)
    except real_models.UnknownModel as error:
        # The CLI reports ValueErrors as bad arguments (exit 2); args[0] is the message unquoted.
        raise ValueError(error.args[0]) from error
    return GpuSpec(model.name, model.memory_bytes, model.pinned_Bps, model.dense_bf16_flops * SUSTAINED_FRACTION)


def _groups(model: nn.Module, declared: tuple[str, ...] | None, notes: list[str], name: str) -> tuple[str, ...]:
    try:
        groups = declared or declared_layer_groups(model)
    except LayoutError:  # its message tells a library user how to declare them: not the plan's reader's business
        notes.append(f"{name}: {type(model).__name__} has no layer groups to stream; planned resident or "
                     "model-offloaded")
        return ()
    try:
        for path in groups:
            resolve_layer_group(model, path)
    except LayoutError as error:
        notes.append(f"{name}: its layer groups do not resolve ({error}); planned resident or model-offloaded")
        return ()
    return tuple(groups)


EXPERTS = ("transformer", "transformer_2")


def pipeline_stages(pipeline: str, components) -> tuple[Stage, ...]:
    """The pipeline's stages; with two experts (Wan2.2 A14B) each is its own phase of denoising: one
    runs per step, so the plan's peak holds one expert's working set while the other is idle
    (parked, streamed or resident, as the plan decides), and the switch is where residency changes."""
    stages = STAGES[pipeline]
    if "image_encoder" in components:  # Wan2.1's CLIP and HunyuanVideo 1.5's SigLIP run beside the text encoders
        encode, *rest = stages
        stages = (Stage(encode.name, (*encode.components, "image_encoder")), *rest)
    experts = tuple(e for e in EXPERTS if e in components)
    if len(experts) < 2:
        return stages
    encode, _, decode = stages
    return (encode, *(Stage(f"denoise:{e}", (e,)) for e in experts), decode)


def expert_steps(steps: int, scheduler: Mapping[str, Any], boundary_ratio: float, flow_shift: float) -> tuple[int, int]:
    """(high-noise, low-noise) steps: the scheduler's timesteps at ``flow_shift`` split at the boundary,
    as WanPipeline switches (t >= boundary_ratio x num_train_timesteps runs the first expert).
    Wan's UniPC configuration without diffusers (``flow_timesteps``); any other through it."""
    config = {**scheduler["config"], "flow_shift": flow_shift}
    high = high_noise_steps(steps, config, boundary_ratio) if scheduler["class"] == "UniPCMultistepScheduler" else None
    if high is not None:
        return high, steps - high
    import diffusers  # as build_meta: offload_core stays importable with torch alone

    sched = getattr(diffusers, scheduler["class"]).from_config(config)
    sched.set_timesteps(steps)
    high = int((sched.timesteps >= boundary_ratio * sched.config.num_train_timesteps).sum())
    return high, steps - high


def _uses_and_tokens(pipeline: str, defaults: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """(uses per request, tokens per use) per component, from the pipeline's generation defaults
    (``expert_steps``: the two experts' share of the steps, when there are two)."""
    steps, cfg = int(defaults["num_inference_steps"]), float(defaults.get("guidance_scale", 1.0))
    h, w, seq = int(defaults["height"]), int(defaults["width"]), int(defaults.get("max_sequence_length", 512))
    if pipeline in ("WanPipeline", "WanImageToVideoPipeline"):  # image-to-video: 36 input channels, same tokens
        passes = 2 if cfg > 1.0 else 1  # conditional + unconditional forward per step
        frames = (int(defaults["num_frames"]) - 1) // 4 + 1  # 4x temporal VAE compression
        # VAE spatial factor x the transformer's 2x2 patches: 8 x 2 (Wan2.1, A14B), 16 x 2 (TI2V-5B).
        patch = 2 * int(defaults.get("vae_spatial", 8))
        tokens = frames * (h // patch) * (w // patch)
        high, low = defaults.get("expert_steps", (steps, 0))
        return {"text_encoder": (passes, seq), "transformer": (high * passes, tokens),
                "transformer_2": (low * passes, tokens),
                # Wan2.1 image-to-video: CLIP ViT-H/14 once on the reference, 16 x 16 patches + the class token
                "image_encoder": (1, int(defaults.get("image_tokens", CLIP_IMAGE_TOKENS))),
                # the Wan VAE decodes one latent frame per decoder pass
                "vae": (frames, (h // 4) * (w // 4))}
    if pipeline in _IMAGE_PIPELINES:
        return _IMAGE_PIPELINES[pipeline](steps, cfg, (h // 16) * (w // 16), seq) | {"vae": (1, (h // 4) * (w // 4))}
    if pipeline in ("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"):
        passes = 1 if cfg == 1.0 else 2  # the guider's conditional + unconditional forward per step
        frames = (int(defaults["num_frames"]) - 1) // 4 + 1  # 4x temporal, 16x spatial VAE compression
        # Qwen2.5-VL tokens (padded to 1000), ByT5 glyph tokens, 729 image tokens (zeros in text-to-video)
        text = seq + 256 + SIGLIP_IMAGE_TOKENS
        return {"text_encoder": (passes, seq + 108), "text_encoder_2": (passes, 256),
                "transformer": (steps * passes, frames * (h // 16) * (w // 16) + text),
                "image_encoder": (1, SIGLIP_IMAGE_TOKENS),  # image-to-video: SigLIP once on the reference
                "vae": (frames, (h // 4) * (w // 4))}
    if pipeline in ("QwenImageEditPlusPipeline", "QwenImageEditPipeline"):
        # An edit: the image's latents (fitted to 1024^2 px: 4096 packed tokens, as KONTEXT_IMAGE_TOKENS) follow
        # the output's in every forward; the prompt's hidden states after the template's 64-token system prefix
        # (which the pipeline drops) carry the image's vision tokens. True CFG as Qwen-Image's. The VAE encodes
        # the image before it decodes the result.
        vision = QWEN_EDIT_PLUS_VISION_TOKENS if pipeline == "QwenImageEditPlusPipeline" else QWEN_EDIT_VISION_TOKENS
        passes = 2 if cfg > 1.0 else 1
        return {"text_encoder": (passes, 64 + vision + PROMPT_TOKENS),
                "transformer": (steps * passes, (h // 16) * (w // 16) + KONTEXT_IMAGE_TOKENS + vision + PROMPT_TOKENS),
                "vae": (2, (h // 4) * (w // 4))}
    if pipeline == "FluxKontextPipeline":
        # An edit: the image fitted to about a megapixel joins the sequence (4096 tokens, as a 1024x1024
        # output's), and the VAE encodes it before it decodes the result. Guidance-distilled: one pass a step.
        return {"text_encoder": (1, 77), "text_encoder_2": (1, seq),
                "transformer": (steps, (h // 16) * (w // 16) + KONTEXT_IMAGE_TOKENS + seq),
                "vae": (2, (h // 4) * (w // 4))}
    # FLUX.1-dev is guidance-distilled: one transformer pass per step.
    return {"text_encoder": (1, 77), "text_encoder_2": (1, seq), "transformer": (steps, (h // 16) * (w // 16) + seq),
            "vae": (1, (h // 4) * (w // 4))}


def _sd3(steps: int, cfg: float, image: int, seq: int) -> dict[str, tuple[int, int]]:
    # Guidance encodes the negative prompt too and runs both branches as one batch of two per step.
    rows = 2 if cfg > 1.0 else 1
    return {"text_encoder": (rows, 77), "text_encoder_2": (rows, 77), "text_encoder_3": (rows, seq),
            "transformer": (steps, rows * (image + 77 + seq))}


def _z_image(steps: int, cfg: float, image: int, seq: int) -> dict[str, tuple[int, int]]:
    rows = 2 if cfg > 0.0 else 1  # Z-Image guides at any scale above 0 (Turbo runs at 0), both branches batched
    return {"text_encoder": (rows, seq), "transformer": (steps, rows * (image + PROMPT_TOKENS))}


def _qwen_image(steps: int, cfg: float, image: int, seq: int) -> dict[str, tuple[int, int]]:
    passes = 2 if cfg > 1.0 else 1  # true CFG: a second transformer forward per step, on the negative prompt
    return {"text_encoder": (passes, PROMPT_TOKENS + 34), "transformer": (steps * passes, image + PROMPT_TOKENS)}


_IMAGE_PIPELINES = {"StableDiffusion3Pipeline": _sd3, "ZImagePipeline": _z_image, "QwenImagePipeline": _qwen_image}


def real_model_facts(model_name: str, gpu: GpuSpec, host_ram: int, *, working_set: int | None = None,
                     pageable_Bps: float | None = None, steps: int | None = None, flow_shift: float | None = None,
                     tables: HostTablesConfig = HostTablesConfig(), tp_size: int = 1,
                     vae_tiled: bool = False) -> tuple[PipelineFacts, list[str]]:
    """Facts for a real-size model from the published configs, planned for ``gpu`` and ``host_ram``.

    ``tp_size > 1``: only the stages with a tensor-parallel plan, as one rank (rank 0) holds them.
    ``working_set``: device bytes kept free of weights (None: :func:`working_set_for`).
    ``flow_shift``: a two-expert model's timestep shift (default: the model's published sampling shift).
    ``vae_tiled``: the decoder's VAE decodes tile by tile (the service's vae_tiling), its working set sized so.
    """
    try:
        specs = [real_models.component_spec(model_name, c) for c in real_models.component_names(model_name)]
        pipeline, defaults = real_models.pipeline_class(model_name), real_models.pipeline_defaults(model_name)
    except real_models.UnknownModel as error:
        # The CLI reports ValueErrors as bad arguments (exit 2); args[0] is the message unquoted.
        raise ValueError(error.args[0]) from error
    if steps is not None:
        fewest = min_steps(real_models.scheduler_config(model_name).get("config", {}))
        if steps < fewest:
            raise ValueError(f"--steps {steps}: {model_name} needs at least {fewest} (its scheduler's shift_terminal "
                             "makes a shorter schedule NaN; the service refuses such requests)")
        defaults["num_inference_steps"] = steps
    notes = []
    if "transformer_2" in {s.component for s in specs}:
        notes.append(_experts(model_name, defaults, flow_shift))
    elif flow_shift is not None:
        raise ValueError(f"--shift applies to a two-expert model; {model_name} has one transformer")
    # An empty layer_groups (none declared) lets _groups fall back to the model's own declaration.
    load = {s.component: (s.class_name, s.config, s.dtype, s.layer_groups) for s in specs}
    facts, more = pipeline_facts(pipeline, load, defaults, gpu, host_ram, working_set, pageable_Bps, tables, tp_size,
                                 vae_tiled)
    return facts, notes + more


def _experts(model_name: str, defaults: dict[str, Any], flow_shift: float | None) -> str:
    """Sets ``defaults["expert_steps"]``; the note saying how the steps split and why."""
    steps, scheduler = int(defaults["num_inference_steps"]), real_models.scheduler_config(model_name)
    ratio = real_models.boundary_ratio(model_name)
    shift = float(defaults.get("flow_shift", scheduler["config"]["flow_shift"]) if flow_shift is None else flow_shift)
    high, low = defaults["expert_steps"] = expert_steps(steps, scheduler, ratio, shift)
    folder_shift = scheduler["config"]["flow_shift"]
    other = expert_steps(steps, scheduler, ratio, folder_shift)
    return (f"experts: transformer (high noise) runs {high} of {steps} steps, transformer_2 (low noise) {low}: "
            f"timesteps >= {ratio} x 1000 at flow_shift {shift:g} (the diffusers folder's scheduler says "
            f"{folder_shift:g}: {other[0]}/{other[1]}); one expert runs per step")


def _tp_stages(pipeline: str, load: Mapping[str, tuple], tp_size: int) -> tuple[Stage, ...]:
    """The pipeline's stages, or with ``tp_size > 1`` those whose components all have a tensor-parallel plan."""
    if tp_size == 1:
        return pipeline_stages(pipeline, load)
    stages = tuple(s for s in pipeline_stages(pipeline, load) if all(has_plan(load[c][0]) for c in s.components))
    if not stages:
        raise ValueError(f"no stage of {pipeline} has a tensor-parallel plan for --tp {tp_size}; "
                         f"classes with plans: {list(classes_with_plans())}")
    for name in (c for s in stages for c in s.components):
        check_heads_divide(name, load[name][0], load[name][1], tp_size)
    return stages


def _profile(name: str, module: nn.Module, tp_size: int, notes: list[str], **kwargs) -> ComponentProfile:
    if tp_size == 1:
        return profile_component(name, module, **kwargs)
    whole = sum(p.numel() * p.element_size() for p in module.parameters())
    with planning_world(tp_size) as mesh:
        shard_planned(module, mesh)
        profile = profile_component(name, module, **kwargs)
        local = sum(local_nbytes(p) for p in module.parameters())
        kept = sum(local_nbytes(p) for _, p in sharded_parameters(module))
    notes.append(f"{name}: tensor-parallel over {tp_size} ranks; rank 0 holds {local / GiB:.2f} of "
                 f"{whole / GiB:.2f} GiB ({local / whole:.3f}), {kept / GiB:.2f} GiB of it sharded and kept on "
                 f"its device, {sum(l.nbytes for l in profile.layers) / GiB:.3f} GiB in streamable layers")
    return profile


def working_set_for(pipeline: str, load: Mapping[str, tuple], defaults: Mapping[str, Any],
                    vae_tiled: bool = False) -> tuple[int, str]:
    """Device bytes the plan keeps free of weights, and the note saying why: the larger of one Denoiser forward
    and one VAE decode at the default request (measured on meta: :mod:`offload_core.planner.meta_activations`)
    with the service's 15 % lease margin, never less than :data:`WORKING_SET_FLOOR`."""
    request = planned_request(pipeline, load, defaults, vae_tiled)
    peaks = [meta_activations.planned_peak(call, pipeline, *load[call.component][:3], request)
             for call in Call if call.component in load]
    said = "; ".join(f"one {p.call.value} call holds {p.bytes / GiB:.2f} GiB ({p.why})" if p.bytes is not None
                     else f"the {p.call.value} call was not measured ({p.why})" for p in peaks)
    largest = max((p.bytes for p in peaks if p.bytes is not None), default=0)
    margined = math.ceil(ACTIVATION_MARGIN * largest)
    kept = max(WORKING_SET_FLOOR, margined)
    return kept, (f"working set {kept / GiB:.2f} GiB at {request.describe()}: {said}; {ACTIVATION_MARGIN} x the "
                  f"larger is {margined / GiB:.2f} GiB, the floor {WORKING_SET_FLOOR / GiB:.2f} GiB")


def pipeline_facts(pipeline, load, defaults, gpu: GpuSpec, host_ram: int, working_set: int | None,
                   pageable_Bps: float, tables: HostTablesConfig, tp_size: int = 1,
                   vae_tiled: bool = False) -> tuple[PipelineFacts, list[str]]:
    notes: list[str] = []
    if working_set is None:
        working_set, why = working_set_for(pipeline, load, defaults, vae_tiled)
        notes.append(why)
    if "vae" in load:  # a Wan2.2 VAE compresses 16x, not 8x: a quarter of the transformer's tokens
        defaults = {**defaults, "vae_spatial": load["vae"][1].get("scale_factor_spatial") or 8}
    if "image_encoder" in load:  # the CLIP ViT's own patches + the class token (a tiny folder's are not 257)
        vision = load["image_encoder"][1]
        if "image_size" in vision and "patch_size" in vision:
            defaults = {**defaults, "image_tokens": (vision["image_size"] // vision["patch_size"]) ** 2 + 1}
    work = _uses_and_tokens(pipeline, defaults)
    stages = _tp_stages(pipeline, load, tp_size)
    profiles: list[ComponentProfile] = []
    for name in (c for s in stages for c in s.components):
        class_name, config, dtype, groups = load[name]
        uses, tokens = work[name]

        def build(name=name, class_name=class_name, config=config, dtype=dtype, groups=groups, uses=uses):
            built_notes: list[str] = []
            # A committed skeleton (same shapes, no library import) where one matches; tensor-parallel
            # plans read the real class's config and modules.
            module = skeletons.skeleton_module(class_name, config, dtype) if tp_size == 1 else None
            if module is None:
                module = real_models.build_meta(class_name, config, dtype)
            return _profile(name, module, tp_size, built_notes, uses_per_request=uses, tables=tables,
                            layer_groups=_groups(module, groups, built_notes, name)), built_notes

        if tp_size == 1:  # a sharded profile is built each time: its layouts come from a fake process group
            key = facts_cache.profile_key(name, class_name, config, dtype, groups, uses, tables)
            profile, built_notes = facts_cache.cached_profile(key, build)
        else:
            profile, built_notes = build()
        notes += built_notes
        profiles.append(with_compute(profile, tokens, gpu.flops))
    lease = max(0, host_ram - default_reserve(host_ram))
    notes.append(f"host: {host_ram / GiB:.0f} GiB, {lease / GiB:.1f} GiB may be pinned after the reserve; "
                 f"compute estimated at {gpu.flops / 1e12:.0f} TFLOP/s sustained")
    pageable_Bps = gpus.link_Bps()[1] if pageable_Bps is None else pageable_Bps  # the table's measured figure
    facts = PipelineFacts(tuple(profiles), stages, gpu.memory_bytes, LinkFacts(gpu.pinned_Bps, pageable_Bps),
                          lease, working_set_bytes=working_set, device_name=gpu.name)
    return facts, notes
