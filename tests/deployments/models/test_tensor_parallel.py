"""Tensor-parallel DiTs: FLUX.1's and Qwen-Image's transformer over 2 gloo ranks with the plan diffusers
ships, loaded as a rank loads a stage's components (rank_components), against the unsharded model; and
the deploy-time check (a Denoiser of theirs at tp_size 2 is accepted, a CLIP encoder refused, a tp_size
that does not divide the heads refused)."""
from __future__ import annotations

import datetime
import socket

import pytest
import torch

from deployments.models import families
from deployments.models.tensor_parallel import NoStagePlan, check_tp, rank_components
from deployments.wire.spec import PipelineStage
from offload_core.tensor_parallel.plans import HeadsDoNotDivide
from tests import ranks
from zoo.tiny import ensure_tiny_flux, ensure_tiny_wan
from zoo.tiny_families import ensure_tiny_qwen_image

FOLDERS = {"flux": ensure_tiny_flux, "qwen-image": ensure_tiny_qwen_image}


def _inputs(family: str, config) -> dict:
    g = torch.Generator().manual_seed(5)
    text = torch.randn(2, 7, config.joint_attention_dim, generator=g)
    if family == "flux":
        inputs = {"hidden_states": torch.randn(2, 16, config.in_channels, generator=g), "encoder_hidden_states": text,
                  "pooled_projections": torch.randn(2, config.pooled_projection_dim, generator=g),
                  "timestep": torch.tensor([0.5, 0.25]), "img_ids": torch.rand(16, 3, generator=g) * 4,
                  "txt_ids": torch.zeros(7, 3)}
        return inputs | ({"guidance": torch.tensor([3.5, 3.5])} if config.guidance_embeds else {})
    return {"hidden_states": torch.randn(2, 16, config.in_channels, generator=g), "encoder_hidden_states": text,
            "encoder_hidden_states_mask": torch.ones(2, 7, dtype=torch.long), "timestep": torch.tensor([0.5, 0.25]),
            "img_shapes": [[(1, 4, 4)]] * 2}


def _rank(rank: int, port: int, folders: dict, out) -> None:
    import diffusers

    from offload_core.tensor_parallel.sharded import local_nbytes, sharded_parameters

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                         timeout=datetime.timedelta(seconds=60))
    try:
        for family, folder in folders.items():
            facts = families.read_family_traits(folder)
            sharded = rank_components(facts, PipelineStage.DENOISE, torch.float32, 2, rank)["transformer"]
            plain = getattr(diffusers, type(sharded).__name__).from_pretrained(folder, subfolder="transformer").eval()
            inputs = _inputs(family, plain.config)
            with torch.no_grad():
                want = plain(**inputs, return_dict=False)[0]
                got = sharded(**inputs, return_dict=False)[0]
            whole = sum(p.numel() * p.element_size() for p in plain.parameters())
            out.put((family, rank, (got - want).abs().max().item(), len(sharded_parameters(sharded)),
                     sum(local_nbytes(p) for p in sharded.parameters()) / whole))
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_dits_over_2_gloo_ranks_with_diffusers_plan_answer_what_the_unsharded_dit_does():
    folders = {family: str(ensure()) for family, ensure in FOLDERS.items()}  # built once, before the ranks read them
    ctx = ranks.context()
    out = ctx.Queue()
    port = _free_port()
    processes = [ctx.Process(target=_rank, args=(r, port, folders, out)) for r in range(2)]
    for p in processes:
        p.start()
    results = [out.get(timeout=300) for _ in range(2 * len(folders))]
    for p in processes:
        p.join(timeout=60)
        assert p.exitcode == 0, p.exitcode
    for family, rank, diff, count, fraction in sorted(results):
        print(f"{family} rank {rank}: max |sharded - unsharded| = {diff:.3g} (fp32), {count} parameters sharded, "
              f"{fraction:.3f} of the weight bytes held")
        assert diff <= 1e-5, (family, rank, diff)
        assert count > 0 and fraction < 0.8, (family, rank, count, fraction)


def test_the_denoiser_of_flux_and_qwen_image_accepts_tp_2_and_a_clip_encoder_is_refused_naming_the_plans():
    for ensure in FOLDERS.values():
        check_tp(families.read_family_traits(ensure()), PipelineStage.DENOISE, 2)
    with pytest.raises(NoStagePlan, match=r"text_encoder \(CLIPTextModel\) has no tensor-parallel plan; plans exist "
                                          r"for \['FluxTransformer2DModel', 'QwenImageTransformer2DModel', "
                                          r"'T5EncoderModel', 'UMT5EncoderModel'\]"):
        check_tp(families.read_family_traits(ensure_tiny_flux()), PipelineStage.ENCODE, 2)


def test_a_tp_size_that_does_not_divide_the_attention_heads_is_refused_at_deploy_naming_the_sizes_that_do():
    # A rank runs whole heads: the tiny umT5 has 4, the tiny Flux DiT 2. Refused from config.json, before
    # a rank loads anything (the rank's own check would fail each replica start instead).
    with pytest.raises(HeadsDoNotDivide, match=r"tp_size 3: the encode stage's text_encoder \(UMT5EncoderModel\) "
                                               r"has 4 attention heads, which do not divide over 3 ranks; a tp_size "
                                               r"that divides 4: 2, 4"):
        check_tp(families.read_family_traits(ensure_tiny_wan()), PipelineStage.ENCODE, 3)
    with pytest.raises(HeadsDoNotDivide, match=r"transformer \(FluxTransformer2DModel\) has 2 attention heads"):
        check_tp(families.read_family_traits(ensure_tiny_flux()), PipelineStage.DENOISE, 4)
    check_tp(families.read_family_traits(ensure_tiny_wan()), PipelineStage.ENCODE, 4)
