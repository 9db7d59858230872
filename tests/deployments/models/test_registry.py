"""Which adapter serves a folder, and the deploy-time refusals that name the supported families."""
from __future__ import annotations

import json
import shutil

import pytest

from deployments.app import AppArgs, build_app
from deployments.models.registry import UnsupportedModelFolder, adapters, read_family_traits
from deployments.wire.spec import Family
from zoo import wan22


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
