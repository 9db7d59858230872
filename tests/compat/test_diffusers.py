"""diffusers' private API as compat/diffusers.py relies on it: each test fails, naming the seam, when an upgrade moved it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from compat import diffusers as seam
from compat.checked import REGISTRY

diffusers = pytest.importorskip("diffusers")  # a dependency: importorskip only keeps collection fast to fail


def use(name: str):
    return REGISTRY[f"compat.diffusers.{name}"]


@pytest.fixture(scope="module")
def tiny_flux():
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))


def test_tp_plan_is_on_the_classes_that_ship_one():
    plan = seam.tp_plan_of(diffusers.FluxTransformer2DModel)
    assert isinstance(plan, dict) and plan, use("tp_plan_of").mismatch("is no longer a non-empty dict on Flux")
    assert seam.tp_plan_of(nn.Linear) is None


def test_tp_checks_refuse_heads_that_do_not_divide(tiny_flux):
    plan = seam.tp_plan_of(type(tiny_flux))
    seam.check_tp_supported(tiny_flux, plan, 2, 2)  # 2 heads over 2 ranks: accepted
    with pytest.raises(Exception, match="head|divis"):
        seam.check_tp_supported(tiny_flux, plan, 2, 3)


def test_tp_plan_resolves_to_blocks_and_torch_styles(tiny_flux):
    from torch.distributed.tensor.parallel import ParallelStyle

    blocks = seam.resolve_tp_plan(tiny_flux, seam.tp_plan_of(type(tiny_flux)))
    assert len(blocks) == 2, use("resolve_tp_plan").mismatch(f"found {len(blocks)} blocks in a 1+1-block Flux")
    for block, relative in blocks:
        assert isinstance(block, nn.Module) and relative
        styles = seam.tp_styles(relative)
        assert styles and all(isinstance(s, ParallelStyle) for s in styles.values()), use("tp_styles").mismatch(
            f"returned {styles}")


@pytest.mark.parametrize("pipeline", ["FluxPipeline", "QwenImagePipeline"])
def test_unpack_latents_inverts_the_pipelines_packing(pipeline):
    cls = getattr(diffusers, pipeline)
    pipe = cls.__new__(cls)  # the seam reads only the class's static method and the scale factor
    pipe.vae_scale_factor = 8
    latents = torch.randn(1, 16, 4, 4)
    packed = cls._pack_latents(latents, 1, 16, 4, 4)
    out = seam.unpack_latents(pipe, packed, 32, 32)
    assert torch.equal(out.reshape(latents.shape), latents), use("unpack_latents").mismatch(f"on {pipeline}")


def test_execution_device_is_where_the_modules_are(tiny_flux):
    class OneModel(diffusers.DiffusionPipeline):
        def __init__(self, transformer):
            super().__init__()
            self.register_modules(transformer=transformer)

    assert seam.execution_device(OneModel(tiny_flux)) == torch.device("cpu"), use("execution_device").mismatch("moved")


def test_keep_in_fp32_modules_is_what_wan_keeps():
    assert hasattr(diffusers.ModelMixin, "_keep_in_fp32_modules"), use("keep_in_fp32_modules").mismatch("is gone")
    kept = seam.keep_in_fp32_modules(diffusers.WanTransformer3DModel)
    assert {"time_embedder", "scale_shift_table"} <= kept, use("keep_in_fp32_modules").mismatch(f"is {kept}")
    assert seam.keep_in_fp32_modules(nn.Linear(1, 1)) == frozenset()


def test_repeated_blocks_are_declared_on_the_model_class():
    assert seam.repeated_block_names(diffusers.FluxTransformer2DModel) == (
        "FluxTransformerBlock", "FluxSingleTransformerBlock"), use("repeated_block_names").mismatch("moved")
    assert seam.repeated_block_names(nn.Linear) == ()


def test_latent_image_ids_are_zero_row_column_per_token_as_the_kontext_pipeline_makes_them():
    from zoo import tiny

    pipe = diffusers.FluxKontextPipeline.from_pretrained(tiny.ensure_tiny_flux_kontext())
    ids = seam.latent_image_ids(pipe, 2, 3, torch.device("cpu"), torch.float32)
    expected = torch.tensor([[0, r, c] for r in range(2) for c in range(3)], dtype=torch.float32)
    assert torch.equal(ids, expected), use("latent_image_ids").mismatch(f"gave {ids.tolist()}")
    image = torch.rand(1, 3, 16, 16) * 2 - 1
    latents = seam.encode_vae_image(pipe, image)
    vae = pipe.vae
    mode = vae.encode(image).latent_dist.mode()
    assert torch.equal(latents, (mode - vae.config.shift_factor) * vae.config.scaling_factor), \
        use("encode_vae_image").mismatch("is no longer the VAE's mode, shifted and scaled")


def test_encode_vae_image_is_the_qwen_edit_pipelines_mode_normalised_by_the_vaes_mean_and_std():
    from zoo import tiny_families

    vae = diffusers.AutoencoderKLQwenImage.from_pretrained(tiny_families.ensure_tiny_qwen_image_edit(), subfolder="vae")
    pipe = diffusers.QwenImageEditPlusPipeline(scheduler=None, vae=vae, text_encoder=None, tokenizer=None,
                                               processor=None, transformer=None)
    image = torch.rand(1, 3, 1, 16, 16) * 2 - 1
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean, std = torch.tensor(vae.config.latents_mean).view(shape), torch.tensor(vae.config.latents_std).view(shape)
    expected = (vae.encode(image).latent_dist.mode() - mean) / std
    assert torch.equal(seam.encode_vae_image(pipe, image), expected), \
        use("encode_vae_image").mismatch("is no longer the Qwen VAE's mode, normalised")
