"""Which stages of a model folder can run tensor-parallel, and one rank's slice of a stage's components.

Runs in ``build_app`` (the deploy-time refusal, reading only the folder's ``model_index.json``) and
in each rank actor of a tensor-parallel stage replica (``rank_components``). The plans themselves
are offload_core's (``offload_core.tensor_parallel.plans``): the T5-family text encoders (ours, loaded
sharded by transformers) and the DiTs diffusers ships a plan for (FLUX.1's and Qwen-Image's
transformer: loaded whole on each rank from the folder, then sharded by ``shard_dit``).
"""
from __future__ import annotations

import json
import logging
import pathlib

import torch

from deployments.models.families import FamilyTraits, stage_component_names
from deployments.wire.spec import PipelineStage
from offload_core.tensor_parallel.plans import check_heads_divide, classes_with_plans, has_plan, load_rank, shard_dit

logger = logging.getLogger(__name__)


class NoStagePlan(ValueError):
    """``tp_size > 1`` for a stage whose components have no tensor-parallel plan (refused at deploy)."""


def stage_classes(facts: FamilyTraits, stage: PipelineStage) -> dict[str, tuple[str, str]]:
    """(library, class name) of each of the stage's components, from the folder's model_index.json."""
    index = json.loads((pathlib.Path(facts.folder) / "model_index.json").read_text())
    return {name: tuple(index[name]) for name in stage_component_names(facts, stage)}


def check_tp(facts: FamilyTraits, stage: PipelineStage, tp_size: int) -> None:
    """Refuse ``tp_size > 1`` for a stage unless every component it loads has a plan, naming what has one.
    The encoder's and the denoiser's deployments run ranks (deployments/replica/stages.py); the decoder's
    components (VAEs) have no plan, so its refusal is the plans'."""
    check_plans(facts, stage, tp_size)


def check_plans(facts: FamilyTraits, stage: PipelineStage, tp_size: int) -> None:
    """Refuse ``tp_size > 1`` for a stage unless every component it loads has a plan, naming those that do,
    and ``tp_size`` divides each one's attention heads."""
    if tp_size == 1:
        return
    classes = stage_classes(facts, stage)
    missing = {name: cls for name, (_, cls) in classes.items() if not has_plan(cls)}
    if missing:
        raise NoStagePlan(
            f"tp_size {tp_size} for the {stage.value} stage of {facts.family.value}: "
            f"{', '.join(f'{n} ({c})' for n, c in missing.items())} has no tensor-parallel plan; "
            f"plans exist for {list(classes_with_plans())} (T5-family text encoders, and the DiTs diffusers "
            "ships a plan for), every other stage runs at tp_size 1")
    for name, (_, cls) in classes.items():  # read from config.json: refused at deploy, not in a rank
        check_heads_divide(f"the {stage.value} stage's {name}", cls,
                           json.loads((pathlib.Path(facts.folder) / name / "config.json").read_text()), tp_size)


def rank_components(facts: FamilyTraits, stage: PipelineStage, dtype: torch.dtype, tp_size: int,
                    rank: int) -> dict[str, torch.nn.Module]:
    """This rank's slice of each of the stage's components, to hand to the pipeline's ``from_pretrained``."""
    check_plans(facts, stage, tp_size)
    loaded = {}
    for name, (library, cls) in stage_classes(facts, stage).items():
        if library == "diffusers":
            loaded[name] = _dit_rank(cls, facts.folder, name, dtype, tp_size)
            continue
        assert library == "transformers", f"{name}: plans exist for transformers and diffusers classes, got {library}"
        import transformers

        loaded[name] = load_rank(getattr(transformers, cls), facts.folder, tp_size, rank, subfolder=name,
                                 torch_dtype=dtype)
    logger.info("rank %d/%d of the %s stage: %s loaded sharded", rank, tp_size, stage.value, sorted(loaded))
    return loaded


def _dit_rank(cls: str, folder: str, name: str, dtype: torch.dtype, tp_size: int) -> torch.nn.Module:
    """The DiT loaded whole from the folder (every rank the same weights), then sharded over this replica's
    group; the other ranks' slices are freed. The mesh is on the rank's device: cuda (NCCL) or cpu (gloo)."""
    import diffusers
    from torch.distributed.device_mesh import init_device_mesh

    model = getattr(diffusers, cls).from_pretrained(folder, subfolder=name, torch_dtype=dtype).eval()
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (tp_size,))
    shard_dit(model, mesh)
    return model
