"""Pipeline facts for the plan CLI: real-size models on the meta device, or a local diffusers folder.

Shapes and dtypes are all the byte figures need, so components are built under
``torch.device("meta")`` from published configs (configs/models/real_model_configs.json) or from
a folder's own config files: a 14B model plans on a laptop. diffusers/transformers are imported
inside the functions (offload_core never imports them at module import time).

Uses per request and tokens per use follow the pipelines' defaults; per-layer compute is
estimated from FLOPs at a sustained fraction of the GPU's dense BF16 rate.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from offload_core.host_memory import default_reserve
from offload_core.host_tables import HostTablesConfig
from offload_core.layout import LayoutError, declared_layer_groups, resolve_layer_group
from offload_core.planner_facts import (ComponentProfile, LinkFacts, PipelineFacts, Stage, profile_component,
                                        with_compute)

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
REAL_CONFIGS = REPO / "configs" / "models" / "real_model_configs.json"
GiB = 1024**3
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# Vendor dense BF16 tensor-core TFLOPs (no sparsity); H100 is the PCIe card's figure.
DENSE_BF16_TFLOPS = {"RTX3060": 25, "L4": 121, "A10G": 70, "RTX4090": 165, "L40S": 362, "A100-40GB": 312,
                     "A100-80GB": 312, "H100": 756, "H200": 989}
# Diffusion transformers sustain ~40 % of peak in practice (attention, norms, launch gaps).
SUSTAINED_FRACTION = 0.4
# The json's note: pageable copies measured ~8 GB/s single-threaded on an x86 H100 host.
PAGEABLE_GBPS = 8.0
STAGES = {
    "WanPipeline": (Stage("encode", ("text_encoder",)), Stage("denoise", ("transformer",)), Stage("decode", ("vae",))),
    "FluxPipeline": (Stage("encode", ("text_encoder", "text_encoder_2")), Stage("denoise", ("transformer",)),
                     Stage("decode", ("vae",))),
}


@dataclass(frozen=True)
class GpuSpec:
    """What the CLI knows of a GPU model: memory, link bandwidth, compute rate."""

    name: str
    memory_bytes: int
    pinned_Bps: float
    flops: float  # sustained FLOP/s used for compute estimates


def _raw() -> dict[str, Any]:
    return json.loads(REAL_CONFIGS.read_text())


def gpu_spec(name: str) -> GpuSpec:
    raw = _raw()
    gpus = {k: v for k, v in raw["gpus"].items() if not k.startswith("_")}
    if name not in gpus:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(gpus)}")
    link = gpus[name]["link"]
    bandwidths = raw["host_to_device_bandwidth_measured_pinned_GBps"]
    pinned = next(v for k, v in bandwidths.items() if not k.startswith("_") and link.startswith(k))
    return GpuSpec(name, int(gpus[name]["memory_gb"]) * GiB, float(pinned) * 1e9,
                   DENSE_BF16_TFLOPS[name] * 1e12 * SUSTAINED_FRACTION)


def _entry(model_name: str) -> dict[str, Any]:
    raw = _raw()
    models = [k for k, v in raw.items() if isinstance(v, dict) and ("pipeline" in v or "same_as" in v)]
    if model_name not in models:
        raise ValueError(f"unknown model {model_name!r}; known: {', '.join(models)}")
    entry = json.loads(json.dumps(raw[model_name]))
    if "same_as" in entry:
        base = _entry(entry.pop("same_as"))
        base["transformer"]["config"].update(entry.pop("transformer_overrides", {}))
        base.update(entry)
        entry = base
    return entry


def build_meta(class_name: str, config: Mapping[str, Any], dtype: torch.dtype) -> nn.Module:
    """``class_name`` (a diffusers or transformers class) at full size on the meta device, in ``dtype``."""
    import diffusers
    import transformers

    with torch.device("meta"):
        if hasattr(diffusers, class_name):
            module = getattr(diffusers, class_name).from_config(dict(config))
        else:
            cls = getattr(transformers, class_name)
            module = cls(cls.config_class(**config))
    # diffusers keeps ``_keep_in_fp32_modules`` (Wan: norms, time embedder) in fp32: count them so.
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    for name, param in module.named_parameters():
        if param.is_floating_point() and not keep.intersection(name.split(".")):
            param.data = param.data.to(dtype)
    return module.eval()


def _groups(model: nn.Module, declared: tuple[str, ...] | None, notes: list[str], name: str) -> tuple[str, ...]:
    try:
        groups = declared or declared_layer_groups(model)
        for path in groups:
            resolve_layer_group(model, path)
        return tuple(groups)
    except LayoutError as error:
        notes.append(f"{name}: no streamable layer groups ({error}); planned resident or model-offloaded")
        return ()


def _uses_and_tokens(pipeline: str, defaults: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """(uses per request, tokens per use) per component, from the pipeline's generation defaults."""
    steps, cfg = int(defaults["num_inference_steps"]), float(defaults.get("guidance_scale", 1.0))
    h, w, seq = int(defaults["height"]), int(defaults["width"]), int(defaults.get("max_sequence_length", 512))
    if pipeline == "WanPipeline":
        passes = 2 if cfg > 1.0 else 1  # conditional + unconditional forward per step
        frames = (int(defaults["num_frames"]) - 1) // 4 + 1  # 4x temporal VAE compression
        return {"text_encoder": (passes, seq), "transformer": (steps * passes, frames * (h // 16) * (w // 16)),
                # the Wan VAE decodes one latent frame per decoder pass
                "vae": (frames, (h // 4) * (w // 4))}
    # FLUX.1-dev is guidance-distilled: one transformer pass per step.
    return {"text_encoder": (1, 77), "text_encoder_2": (1, seq), "transformer": (steps, (h // 16) * (w // 16) + seq),
            "vae": (1, (h // 4) * (w // 4))}


def real_model_facts(model_name: str, gpu: GpuSpec, host_ram: int, *, working_set: int = 3 * GiB,
                     pageable_Bps: float = PAGEABLE_GBPS * 1e9, steps: int | None = None,
                     tables: HostTablesConfig = HostTablesConfig()) -> tuple[PipelineFacts, list[str]]:
    """Facts for a real-size model from the published configs, planned for ``gpu`` and ``host_ram``."""
    entry = _entry(model_name)
    defaults = dict(entry["pipeline_defaults"])
    if steps is not None:
        defaults["num_inference_steps"] = steps
    load = {name: (spec["class"], spec["config"], _DTYPES[spec.get("dtype", "float32")],
                   tuple(spec["layer_groups"]) if "layer_groups" in spec else None)
            for name, spec in entry.items() if isinstance(spec, dict) and "class" in spec and name != "scheduler"}
    return _facts(entry["pipeline"], load, defaults, gpu, host_ram, working_set, pageable_Bps, tables)


def folder_facts(folder: Path, gpu: GpuSpec, host_ram: int, *, working_set: int = 3 * GiB,
                 pageable_Bps: float = PAGEABLE_GBPS * 1e9, steps: int | None = None,
                 tables: HostTablesConfig = HostTablesConfig()) -> tuple[PipelineFacts, list[str]]:
    """Facts for a local diffusers folder: each component built on meta from its own config file."""
    index = json.loads((folder / "model_index.json").read_text())
    pipeline = index["_class_name"]
    if pipeline not in STAGES:
        raise ValueError(f"{folder}: pipeline {pipeline!r} is not one the planner knows ({sorted(STAGES)})")
    load = {}
    for name in (n for s in STAGES[pipeline] for n in s.components):
        config_path = folder / name / "config.json"
        config = {k: v for k, v in json.loads(config_path.read_text()).items() if not k.startswith("_")}
        class_name = index[name][1]
        load[name] = (class_name, config, _folder_dtype(folder / name), None)
    defaults = {"WanPipeline": {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50,
                                "guidance_scale": 5.0, "max_sequence_length": 512},
                "FluxPipeline": {"height": 1024, "width": 1024, "num_inference_steps": 28,
                                 "max_sequence_length": 512}}[pipeline]
    if steps is not None:
        defaults["num_inference_steps"] = steps
    return _facts(pipeline, load, defaults, gpu, host_ram, working_set, pageable_Bps, tables)


def _folder_dtype(component_dir: Path) -> torch.dtype:
    """The dtype of the first floating tensor in the component's safetensors files (header only)."""
    from safetensors import safe_open

    for path in sorted(component_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                dtype = _DTYPES.get(f.get_slice(key).get_dtype())
                if dtype is not None:
                    return dtype
    raise ValueError(f"{component_dir}: no floating-point safetensors weights found")


def _facts(pipeline, load, defaults, gpu: GpuSpec, host_ram: int, working_set: int, pageable_Bps: float,
           tables: HostTablesConfig) -> tuple[PipelineFacts, list[str]]:
    notes: list[str] = []
    work = _uses_and_tokens(pipeline, defaults)
    profiles: list[ComponentProfile] = []
    for name, (class_name, config, dtype, groups) in load.items():
        module = build_meta(class_name, config, dtype)
        uses, tokens = work[name]
        profile = profile_component(name, module, uses_per_request=uses, tables=tables,
                                    layer_groups=_groups(module, groups, notes, name))
        profiles.append(with_compute(profile, tokens, gpu.flops))
    lease = max(0, host_ram - default_reserve(host_ram))
    notes.append(f"host: {host_ram / GiB:.0f} GiB, {lease / GiB:.1f} GiB may be pinned after the reserve; "
                 f"compute estimated at {gpu.flops / 1e12:.0f} TFLOP/s sustained")
    facts = PipelineFacts(tuple(profiles), STAGES[pipeline], gpu.memory_bytes, LinkFacts(gpu.pinned_Bps, pageable_Bps),
                          lease, working_set_bytes=working_set, device_name=gpu.name)
    return facts, notes
