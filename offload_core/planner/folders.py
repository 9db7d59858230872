"""Planning a local diffusers folder: its components from its own configs, its requests from its flagship's defaults.

A folder's config files give every shape the byte figures need; what a request looks like (size,
frames, steps, guidance) is not in them. Each kind of folder the service serves takes the published
generation defaults of its flagship in configs/models/real_model_configs.json, the numbers the
real-size plans use, so a folder and the model it was converted from plan alike. The kind is the
pipeline class (``model_index.json``'s ``_class_name``) plus the mark that tells its variants apart
there: a second expert (Wan2.2 A14B), expanded timesteps (Wan2.2 TI2V-5B), a CLIP image encoder
(Wan2.1 image-to-video). The service's family adapters (deployments/models) recognise the same
folders; tests/offload_core/planner/test_folders.py checks that the planner stages exactly the
components each adapter's stages load.

Run by the plan CLI in the user's shell: reads json and safetensors headers, never weights.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from offload_core.planner import real_models
from offload_core.planner.facts import PipelineFacts
from offload_core.planner.flow_timesteps import min_steps
from offload_core.planner.inputs import GpuSpec, expert_steps, pipeline_facts, pipeline_stages
from offload_core.tables import HostTablesConfig

# safetensors header dtype names of the floating types a folder's weights may be stored in.
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class UnsupportedFolder(ValueError):
    """A folder whose pipeline class, or variant of it, the planner has no defaults for."""


class Mark(enum.Enum):
    """What tells a pipeline class's variants apart in ``model_index.json``."""

    TWO_EXPERTS = "transformer_2"  # Wan2.2 A14B: a low-noise expert beside the high-noise one
    EXPANDED_TIMESTEPS = "expand_timesteps"  # Wan2.2 TI2V-5B: a timestep per latent patch
    IMAGE_ENCODER = "image_encoder"  # Wan2.1 image-to-video: a CLIP vision tower beside the text encoder
    NONE = "none"  # the class's plain layout

    def found_in(self, index: Mapping[str, Any]) -> bool:
        if self is Mark.NONE:
            return True
        if self is Mark.EXPANDED_TIMESTEPS:
            return bool(index.get("expand_timesteps"))
        return self.value in named_components(index)


@dataclass(frozen=True)
class FolderKind:
    """A kind of folder: its pipeline class, its mark, and the real model whose published defaults it takes."""

    pipeline: str
    mark: Mark
    model: str  # an entry of configs/models/real_model_configs.json

    def describe(self) -> str:
        return self.model if self.mark is Mark.NONE else f"{self.model} ({self.mark.value})"


# Every kind of folder the service serves; a class's marked variants before its plain layout (the
# first whose mark is found wins). WanImageToVideoPipeline has no plain row: an image-to-video folder
# with neither a second expert nor an image encoder (TI2V-5B saved as image-to-video, with
# expand_timesteps) is one the service refuses at deploy too.
FOLDER_KINDS: tuple[FolderKind, ...] = (
    FolderKind("WanPipeline", Mark.TWO_EXPERTS, "wan2.2-t2v-a14b"),
    FolderKind("WanPipeline", Mark.EXPANDED_TIMESTEPS, "wan2.2-ti2v-5b"),
    FolderKind("WanPipeline", Mark.NONE, "wan2.1-t2v-14b"),
    FolderKind("WanImageToVideoPipeline", Mark.TWO_EXPERTS, "wan2.2-i2v-a14b"),
    FolderKind("WanImageToVideoPipeline", Mark.IMAGE_ENCODER, "wan2.1-i2v-14b-480p"),
    FolderKind("FluxPipeline", Mark.NONE, "flux.1-dev"),
    FolderKind("FluxKontextPipeline", Mark.NONE, "flux.1-kontext-dev"),
    FolderKind("StableDiffusion3Pipeline", Mark.NONE, "sd3.5-large"),
    FolderKind("ZImagePipeline", Mark.NONE, "z-image-turbo"),
    FolderKind("QwenImagePipeline", Mark.NONE, "qwen-image"),
    FolderKind("QwenImageEditPlusPipeline", Mark.NONE, "qwen-image-edit-2509"),
    FolderKind("QwenImageEditPipeline", Mark.NONE, "qwen-image-edit"),
    FolderKind("HunyuanVideo15Pipeline", Mark.NONE, "hunyuanvideo-1.5-480p-t2v"),
    FolderKind("HunyuanVideo15ImageToVideoPipeline", Mark.NONE, "hunyuanvideo-1.5-480p-i2v"),
)


def supported() -> str:
    """The pipeline classes the planner plans from a folder, each with its kinds, for error messages."""
    classes = dict.fromkeys(k.pipeline for k in FOLDER_KINDS)
    return "; ".join(f"{c}: {', '.join(k.describe() for k in FOLDER_KINDS if k.pipeline == c)}" for c in classes)


def named_components(index: Mapping[str, Any]) -> frozenset[str]:
    """The components ``model_index.json`` names with a class (``[library, class]``, not ``[null, null]``)."""
    return frozenset(k for k, v in index.items() if isinstance(v, list) and len(v) == 2 and v[0] is not None)


def folder_kind(index: Mapping[str, Any], folder: Path | str = "") -> FolderKind:
    """The kind of folder ``index`` (its model_index.json) describes; UnsupportedFolder naming the supported ones."""
    pipeline = index.get("_class_name")
    kinds = [k for k in FOLDER_KINDS if k.pipeline == pipeline]
    if not kinds:
        raise UnsupportedFolder(f"{folder}: pipeline {pipeline!r} is not one the planner plans from a folder; "
                                f"supported: {supported()}")
    for kind in kinds:
        if kind.mark.found_in(index):
            return kind
    raise UnsupportedFolder(f"{folder}: a {pipeline} folder with none of "
                            f"{[k.mark.value for k in kinds]} is not a variant the planner plans; "
                            f"supported: {supported()}")


def folder_facts(folder: Path, gpu: GpuSpec, host_ram: int, *, working_set: int | None = None,
                 pageable_Bps: float | None = None, steps: int | None = None, flow_shift: float | None = None,
                 tables: HostTablesConfig = HostTablesConfig(), vae_tiled: bool = False) -> tuple[PipelineFacts, list[str]]:
    """Facts for a local diffusers folder: each component built on meta from its own config file, the
    requests its kind's published defaults. ``flow_shift``: a two-expert folder's timestep shift
    (default: the folder's scheduler's, which the service runs). ``vae_tiled``: the decoder's VAE tiles."""
    index = json.loads((folder / "model_index.json").read_text())
    kind = folder_kind(index, folder)
    named = named_components(index)
    if "transformer_2" in named and index.get("boundary_ratio") is None:  # which steps run which expert
        raise UnsupportedFolder(f"{folder}: {kind.pipeline} names two experts but no boundary_ratio in "
                                f"model_index.json: the steps cannot be split between them")
    load = {}
    for stage in pipeline_stages(kind.pipeline, named):
        for name in stage.components:
            if name not in named:
                raise UnsupportedFolder(f"{folder}: {kind.pipeline}'s {stage.name} stage needs {name!r}, which "
                                        f"model_index.json does not name (it names {sorted(named)})")
            config = json.loads((folder / name / "config.json").read_text())
            config = {k: v for k, v in config.items() if not k.startswith("_")}
            load[name] = (index[name][1], config, _folder_dtype(folder / name), None)
    defaults = real_models.pipeline_defaults(kind.model)
    published_shift = defaults.pop("flow_shift", None)  # upstream's sampling shift; the folder's scheduler has its own
    if steps is not None:
        scheduler = folder / "scheduler" / "scheduler_config.json"
        fewest = min_steps(json.loads(scheduler.read_text())) if scheduler.is_file() else 1
        if steps < fewest:
            raise UnsupportedFolder(f"--steps {steps}: {folder} needs at least {fewest} (its scheduler's "
                                    "shift_terminal makes a shorter schedule NaN; the service refuses such requests)")
        defaults["num_inference_steps"] = steps
    shown = {k: defaults[k] for k in ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")
             if k in defaults}
    notes = [f"folder: {kind.pipeline} with {kind.mark.value if kind.mark is not Mark.NONE else 'its plain layout'}"
             f", planned at {kind.model}'s published defaults {shown}"]
    if "transformer_2" in load:
        notes.append(_experts(folder, index, defaults, flow_shift, published_shift))
    elif flow_shift is not None:
        raise ValueError(f"--shift applies to a two-expert model; {folder} ({kind.describe()}) has one transformer")
    facts, more = pipeline_facts(kind.pipeline, load, defaults, gpu, host_ram, working_set, pageable_Bps, tables,
                                 vae_tiled=vae_tiled)
    return facts, notes + more


def _experts(folder: Path, index: Mapping[str, Any], defaults: dict[str, Any], flow_shift: float | None,
             published_shift: float | None) -> str:
    """Sets ``defaults["expert_steps"]`` at the folder's scheduler's shift (or ``flow_shift``); the note."""
    raw = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    scheduler = {"class": raw["_class_name"], "config": {k: v for k, v in raw.items() if k[0] != "_"}}
    steps, ratio, own = int(defaults["num_inference_steps"]), index["boundary_ratio"], scheduler["config"]["flow_shift"]
    shift = own if flow_shift is None else flow_shift
    high, low = defaults["expert_steps"] = expert_steps(steps, scheduler, ratio, shift)
    note = (f"experts: transformer (high noise) runs {high} of {steps} steps, transformer_2 (low noise) {low}: "
            f"timesteps >= {ratio} x 1000 at flow_shift {shift:g} "
            f"({'the folder scheduler' if flow_shift is None else '--shift'}'s); one expert runs per step")
    if published_shift is not None and published_shift != shift:
        other = expert_steps(steps, scheduler, ratio, published_shift)
        note += f"; the published model samples at {published_shift:g} ({other[0]}/{other[1]}: --shift {published_shift:g})"
    return note


def _folder_dtype(component_dir: Path) -> torch.dtype:
    """The dtype of the first floating tensor in the component's safetensors files (header only)."""
    from safetensors import safe_open

    for path in sorted(component_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                dtype = _SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype())
                if dtype is not None:
                    return dtype
    raise ValueError(f"{component_dir}: no floating-point safetensors weights found")
