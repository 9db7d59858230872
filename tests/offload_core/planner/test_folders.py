"""A local folder of every family the service serves plans from its model_index.json: the components its
stages load (as the family's adapter loads them) at its flagship's published defaults; other folders are
refused naming the supported ones."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from deployments.models.registry import adapter_for, read_family_traits
from deployments.wire.spec import PipelineStage
from offload_core.planner.cli import main
from zoo.tiny import ensure_tiny_flux, ensure_tiny_flux_kontext, ensure_tiny_wan
from zoo.tiny_families import (
    ensure_tiny_hunyuan15,
    ensure_tiny_hunyuan15_i2v,
    ensure_tiny_qwen_image,
    ensure_tiny_qwen_image_edit,
    ensure_tiny_sd3,
    ensure_tiny_zimage,
)
from zoo.wan22 import ensure_tiny_wan21_i2v, ensure_tiny_wan22_a14b, ensure_tiny_wan22_i2v, ensure_tiny_wan22_ti2v


@dataclass(frozen=True)
class Case:
    name: str
    ensure: Callable[[], Path]
    denoise: tuple[int, ...]  # each expert's transformer forwards per request at the flagship's defaults
    decode: int  # VAE passes per request: latent frames ((frames - 1) / 4 + 1), 1 for an image


CASES = [
    Case("wan2.1", ensure_tiny_wan, (100,), 21),  # 50 steps x 2 (guidance 5), 81 frames
    # 40 steps at the folder's flow_shift 3.0: 13 >= 0.875 x 1000 on the high-noise expert, x 2 (guidance 4); 720p 81 frames
    Case("wan2.2-a14b", ensure_tiny_wan22_a14b, (26, 54), 21),
    Case("wan2.2-ti2v-5b", ensure_tiny_wan22_ti2v, (100,), 31),  # 50 steps x 2, 121 frames
    # 40 steps at shift 3.0: 11 >= 0.9 x 1000, x 2 (guidance 3.5)
    Case("wan2.2-i2v-a14b", ensure_tiny_wan22_i2v, (22, 58), 21),
    Case("wan2.1-i2v", ensure_tiny_wan21_i2v, (100,), 21),
    Case("flux.1", ensure_tiny_flux, (28,), 1),  # guidance-distilled: one forward per step
    Case("flux.1-kontext", ensure_tiny_flux_kontext, (28,), 2),  # the same; the VAE encodes the image too
    Case("sd3.5", ensure_tiny_sd3, (28,), 1),  # both branches in one forward per step
    Case("z-image", ensure_tiny_zimage, (9,), 1),  # Turbo: 9 steps at guidance 0
    Case("qwen-image", ensure_tiny_qwen_image, (100,), 1),  # 50 steps, true CFG: a second forward
    Case("qwen-image-edit", ensure_tiny_qwen_image_edit, (100,), 2),  # the same; the VAE encodes the image too
    Case("hunyuan-video-1.5", ensure_tiny_hunyuan15, (100,), 31),  # 50 steps x 2 (guidance 6), 121 frames
    Case("hunyuan-video-1.5-i2v", ensure_tiny_hunyuan15_i2v, (100,), 31),  # the same, SigLIP in the encode stage
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_folder_of_every_served_family_plans_the_components_its_stages_load(case, capsys):
    folder = case.ensure()
    code = main([str(folder), "--gpu", "L4", "--host-ram", "64GiB", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0 and plan["feasible"] is True
    facts = read_family_traits(folder)
    adapter = adapter_for(facts)
    planned: dict[PipelineStage, list[str]] = {}
    for stage in plan["stages"]:  # a two-expert denoiser is one planned stage per expert: denoise:<expert>
        planned.setdefault(PipelineStage(stage["name"].split(":")[0]), []).extend(stage["components"])
    assert {s: tuple(c) for s, c in planned.items()} == {s: adapter.modules(facts, s) for s in PipelineStage}
    phases = tuple(tuple(s["components"]) for s in plan["stages"] if s["name"].startswith("denoise"))
    assert phases == adapter.phases(facts, PipelineStage.DENOISE)
    uses = {c["name"]: c["uses_per_request"] for c in plan["components"]}
    assert tuple(uses[e] for e in facts.experts) == case.denoise
    assert uses["vae"] == case.decode
    assert all(c["prediction"]["in_use_bytes"] > 0 for c in plan["components"])


def test_a_two_expert_folder_plans_at_its_schedulers_shift_and_says_the_published_one(capsys):
    code = main([str(ensure_tiny_wan22_a14b()), "--gpu", "L4", "--host-ram", "64GiB", "--json", "--shift", "12"])
    plan = json.loads(capsys.readouterr().out)
    # At Wan2.2's sampling shift 12.0: 26 of 40 steps on the high-noise expert (as the real-size plan).
    assert code == 0 and {c["name"]: c["uses_per_request"] for c in plan["components"]}["transformer"] == 52
    assert any("at flow_shift 12 (--shift's)" in n for n in plan["notes"]), plan["notes"]


def _folder(tmp_path: Path, index: dict) -> Path:
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    return tmp_path


@pytest.mark.parametrize("index, message", [
    ({"_class_name": "StableDiffusionXLPipeline", "unet": ["diffusers", "UNet2DConditionModel"]},
     "pipeline 'StableDiffusionXLPipeline' is not one the planner plans from a folder; supported: WanPipeline: "
     "wan2.2-t2v-a14b (transformer_2), wan2.2-ti2v-5b (expand_timesteps), wan2.1-t2v-14b; WanImageToVideoPipeline: "
     "wan2.2-i2v-a14b (transformer_2), wan2.1-i2v-14b-480p (image_encoder); FluxPipeline: flux.1-dev; "
     "FluxKontextPipeline: flux.1-kontext-dev; StableDiffusion3Pipeline: sd3.5-large; ZImagePipeline: z-image-turbo; "
     "QwenImagePipeline: qwen-image; QwenImageEditPlusPipeline: qwen-image-edit-2509; "
     "QwenImageEditPipeline: qwen-image-edit; HunyuanVideo15Pipeline: hunyuanvideo-1.5-480p-t2v; "
     "HunyuanVideo15ImageToVideoPipeline: hunyuanvideo-1.5-480p-i2v"),
    ({"_class_name": "WanImageToVideoPipeline", "expand_timesteps": True, "transformer": ["diffusers", "X"],
      "transformer_2": [None, None], "image_encoder": [None, None]},
     "a WanImageToVideoPipeline folder with none of ['transformer_2', 'image_encoder'] is not a variant"),
    ({"_class_name": "WanPipeline", "transformer": ["diffusers", "X"], "transformer_2": ["diffusers", "X"]},
     "WanPipeline names two experts but no boundary_ratio in model_index.json"),
    ({"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]},
     "FluxPipeline's encode stage needs 'text_encoder', which model_index.json does not name"),
])
def test_a_folder_the_planner_has_no_kind_for_exits_2_naming_the_supported_ones(tmp_path, index, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model-dir", str(_folder(tmp_path, index)), "--gpu", "L4", "--host-ram", "64GiB"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
