"""Which adapter serves a folder, and the deploy-time refusals that name the supported families."""
from __future__ import annotations

import json
import shutil

import pytest

from deployments.app import AppArgs, build_app
from deployments.models.registry import UnsupportedModelFolder, adapters, check_weights, read_family_traits
from deployments.wire.spec import Family
from zoo import wan22
from zoo.tiny import ensure_tiny_flux


def _folder(tmp_path, index: dict):
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    return tmp_path


def test_every_family_module_is_found_and_each_family_has_one_adapter():
    families = [a.family for a in adapters()]
    assert {Family.WAN, Family.WAN_I2V, Family.FLUX} <= set(families)
    assert len(families) == len(set(families))


def test_a_pipeline_with_no_adapter_fails_build_app_naming_the_supported_families(tmp_path):
    folder = _folder(tmp_path, {"_class_name": "CogVideoXPipeline"})
    with pytest.raises(UnsupportedModelFolder) as refused:
        build_app(AppArgs(model_path=str(folder)))
    message = str(refused.value)
    assert "'CogVideoXPipeline' has no adapter" in message
    for named in ("wan (WanPipeline)", "wan-i2v (WanImageToVideoPipeline)", "flux (FluxPipeline)"):
        assert named in message


def test_a_variant_the_adapter_does_not_run_is_refused_with_why_and_the_supported_families(tmp_path):
    # The image-to-video pipeline class with TI2V-5B's expanded timesteps: served from TI2V's own
    # WanPipeline folder, not from an image-to-video folder.
    folder = tmp_path / "i2v-expanded"
    shutil.copytree(wan22.ensure_tiny_wan22_i2v(), folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["expand_timesteps"] = True
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedModelFolder, match="expand_timesteps .* not handled.*supported families: .*wan-i2v"):
        read_family_traits(folder)


def test_the_clip_image_encoder_layout_is_wan21_i2v_and_the_clip_less_one_wan22_i2v():
    wan21, wan22_i2v = read_family_traits(wan22.ensure_tiny_wan21_i2v()), read_family_traits(wan22.ensure_tiny_wan22_i2v())
    assert (wan21.family, wan22_i2v.family) == (Family.WAN21_I2V, Family.WAN_I2V)
    assert wan21.max_n == 1 and wan21.experts == ("transformer",)


def test_a_family_whose_pipeline_needs_a_missing_package_is_refused_naming_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ftfy" else real(name, *a))
    with pytest.raises(UnsupportedModelFolder, match=r"needs the Python package\(s\) \['ftfy'\]"):
        read_family_traits(wan22.ensure_tiny_wan22_i2v())


def _flux_with(tmp_path, change) -> str:
    """A copy of the tiny FLUX.1 folder with ``change(transformer_folder)`` applied."""
    folder = tmp_path / "flux"
    shutil.copytree(ensure_tiny_flux(), folder)
    change(folder / "transformer")
    return str(folder)


def _shard(transformer, missing: bool):
    weights = transformer / "diffusion_pytorch_model.safetensors"
    weights.rename(transformer / "diffusion_pytorch_model-00001-of-00002.safetensors")
    names = {"x.weight": "diffusion_pytorch_model-00001-of-00002.safetensors",
             "y.weight": "diffusion_pytorch_model-00002-of-00002.safetensors"}
    (transformer / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    if not missing:
        shutil.copy(transformer / names["x.weight"], transformer / names["y.weight"])


@pytest.mark.parametrize("change, message", [
    (lambda t: (t / "diffusion_pytorch_model.safetensors").unlink(),
     "transformer: no diffusion_pytorch_model.safetensors nor diffusion_pytorch_model.safetensors.index.json; "
     "it holds no weights file"),
    (lambda t: (t / "diffusion_pytorch_model.safetensors").rename(t / "diffusion_pytorch_model.fp16.safetensors"),
     "it holds diffusion_pytorch_model.fp16.safetensors"),
    (lambda t: (t / "diffusion_pytorch_model.safetensors").rename(t / "diffusion_pytorch_model.bin"),
     "it holds diffusion_pytorch_model.bin"),
    (lambda t: _shard(t, missing=True),
     "transformer: 1 of the 2 shards diffusion_pytorch_model.safetensors.index.json names are missing "
     "(diffusion_pytorch_model-00002-of-00002.safetensors): an interrupted download?"),
], ids=["none", "variant-only", "pickle-only", "partial-download"])
def test_a_component_whose_safetensors_are_missing_fails_build_app_naming_it(tmp_path, change, message):
    folder = _flux_with(tmp_path, change)
    with pytest.raises(UnsupportedModelFolder) as refused:
        build_app(AppArgs(model_path=folder))
    assert message in str(refused.value) and "loads only safetensors" in str(refused.value)


def test_whole_weights_single_or_in_every_named_shard_pass_the_check(tmp_path):
    check_weights(read_family_traits(ensure_tiny_flux()))
    check_weights(read_family_traits(_flux_with(tmp_path, lambda t: _shard(t, missing=False))))
