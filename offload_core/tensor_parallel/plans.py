"""Tensor-parallel plans for the model classes we serve, and loading one rank's slice of a model.

Runs in each rank worker of a tensor-parallel stage replica (``load_rank``, ``shard_dit``) and in
the planner CLI (``shard_planned``, on ``meta`` with a fake process group). transformers and
diffusers are imported inside the functions only: offload_core stays importable with torch alone.

The DiTs diffusers ships a plan for (``_tp_plan`` on FluxTransformer2DModel and
QwenImageTransformer2DModel, diffusers 0.42.1: attention q/k/v and the FFN's input colwise, their
outputs rowwise, Flux's single-block ``proj_out`` packed rowwise; the adaLN modulation and norms
replicated) are sharded by :func:`shard_dit` with diffusers' own checks (``TensorParallelConfig``,
``_check_tp_supported``, ``resolve_tp_shard_specs``) and styles, one ``parallelize_module`` per
block, which is what diffusers' ``apply_tensor_parallel`` runs. Not through ``enable_parallelism``:
in 0.42.1 it works on cuda/neuron/tpu/xpu only (on CPU it fails computing ``rank %
torch.accelerator.device_count()``, then refuses a ``cpu`` mesh), while the styles are torch DTensor
code that runs on gloo too: the tiny Flux over 2 gloo ranks matches the unsharded one within 2.4e-7
(fp32). The attention processors reshape by ``head_dim``, so each rank runs its heads unchanged.

UMT5/T5 ship no ``base_model_tp_plan`` (transformers 5.24), so the plan is ours:

- the token table ``embedding_rowwise`` (vocab-parallel: each rank holds vocab/N rows, the
  partial lookups are summed) on **both** ``shared`` and ``encoder.embed_tokens``: they are one
  tied Parameter, and listing one path fails with "mixed torch.Tensor and DTensor";
- the FFN's input projections ``colwise`` and its output ``rowwise`` (one all-reduce per FFN);
- attention ``q``/``k``/``v`` ``colwise`` and ``o`` ``rowwise``: each rank runs n_heads/N heads,
  so each attention module's ``n_heads`` and ``inner_dim`` are divided by N after loading, and
  the relative-position bias (num_buckets x n_heads, 32 x 64 on umT5-XXL: 8 KiB, replicated)
  gives each rank its own heads' columns.
"""
from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from compat import diffusers as diffusers_compat
from compat.torch import own_parameters, register_fake_backend, replace_local_tensor
from offload_core.tensor_parallel.sharded import sharded_parameters

logger = logging.getLogger(__name__)

TP_HEADS_ATTRIBUTE = "_offload_tp_heads"  # (rank, tp_size) once an attention module's heads were divided


class NoTensorParallelPlan(ValueError):
    """``tp_size > 1`` asked for a model class without a tensor-parallel plan."""


class HeadsDoNotDivide(ValueError):
    """``tp_size`` does not divide a planned model's attention heads (each rank runs whole heads)."""


@dataclass(frozen=True)
class TensorParallelPlan:
    """One model's plan: module path patterns (``*`` for a layer number) to transformers' TP styles."""

    class_name: str
    rules: tuple[tuple[str, str], ...]

    def as_dict(self) -> dict[str, str]:
        return dict(self.rules)


def _t5_encoder_rules(config: Any) -> tuple[tuple[str, str], ...]:
    attention = "encoder.block.*.layer.*.SelfAttention"
    ffn = "encoder.block.*.layer.*.DenseReluDense"
    inputs = ("wi_0", "wi_1") if getattr(config, "is_gated_act", False) else ("wi",)
    return (("shared", "embedding_rowwise"), ("encoder.embed_tokens", "embedding_rowwise"),
            *((f"{attention}.{p}", "colwise") for p in ("q", "k", "v")), (f"{attention}.o", "rowwise"),
            *((f"{ffn}.{p}", "colwise") for p in inputs), (f"{ffn}.wo", "rowwise"))


# By class name: a function of the model's config (T5's FFN is gated or not).
KNOWN_TP_PLANS: Mapping[str, Callable[[Any], tuple[tuple[str, str], ...]]] = {
    "UMT5EncoderModel": _t5_encoder_rules,
    "T5EncoderModel": _t5_encoder_rules,
}


# DiTs sharded with the plan diffusers ships on their class (see the module docstring).
DIFFUSERS_TP_CLASSES = frozenset({"FluxTransformer2DModel", "QwenImageTransformer2DModel"})


def classes_with_plans() -> tuple[str, ...]:
    return tuple(sorted({*KNOWN_TP_PLANS, *DIFFUSERS_TP_CLASSES}))


def has_plan(class_name: str) -> bool:
    return class_name in KNOWN_TP_PLANS or class_name in DIFFUSERS_TP_CLASSES


def check_heads_divide(name: str, class_name: str, config: Mapping | Any, tp_size: int) -> None:
    """Raise :class:`HeadsDoNotDivide` unless ``tp_size`` divides the model's attention heads.

    Every plan gives each rank n_heads/N whole heads (``divide_attention_heads`` for the T5 family,
    diffusers' own check for the DiTs): read from the config alone, so a deploy or a plan is refused
    before any rank loads a weight. ``config``: the config.json mapping or the config object.
    """
    keys = ("num_heads", "num_attention_heads")
    found = [config.get(k) if isinstance(config, Mapping) else getattr(config, k, None) for k in keys]
    heads = next((h for h in found if isinstance(h, int)), None)
    if heads is not None and heads % tp_size:
        fits = [n for n in range(2, heads + 1) if heads % n == 0][:4]
        raise HeadsDoNotDivide(f"tp_size {tp_size}: {name} ({class_name}) has {heads} attention heads, which do "
                               f"not divide over {tp_size} ranks; a tp_size that divides {heads}: "
                               f"{', '.join(map(str, fits))}, ...")


def tp_plan_for(class_name: str, config: Any) -> TensorParallelPlan:
    """The plan of ``class_name``; a class without one raises, naming the classes that have one."""
    rules = KNOWN_TP_PLANS.get(class_name)
    if rules is None and class_name in DIFFUSERS_TP_CLASSES:
        raise NoTensorParallelPlan(f"{class_name} is sharded with the plan diffusers ships (shard_dit), "
                                   "not a transformers plan")
    if rules is None:
        raise NoTensorParallelPlan(
            f"{class_name} has no tensor-parallel plan; tp_size > 1 is supported for {list(classes_with_plans())}")
    return TensorParallelPlan(class_name, rules(config))


def divide_attention_heads(model: nn.Module, tp_size: int, rank: int) -> int:
    """Give every T5-style attention module its rank's n_heads/N heads; returns how many were divided.

    The colwise q/k/v already hold this rank's heads' columns (head-major, d_kv each), so the
    reshape to heads must use n_heads/N; the relative-position bias table keeps every head
    (replicated, 8 KiB on umT5-XXL) and its lookup is cut to this rank's heads.
    """
    divided = 0
    for name, module in model.named_modules():
        if not (hasattr(module, "n_heads") and hasattr(module, "inner_dim") and hasattr(module, "key_value_proj_dim")):
            continue
        if getattr(module, TP_HEADS_ATTRIBUTE, None) is not None:
            raise ValueError(f"{name}: heads were already divided for tp {getattr(module, TP_HEADS_ATTRIBUTE)}")
        if module.n_heads % tp_size:
            raise ValueError(f"{name}: {module.n_heads} heads do not divide over tp_size {tp_size}")
        heads = module.n_heads // tp_size
        module.n_heads, module.inner_dim = heads, heads * module.key_value_proj_dim
        bias = getattr(module, "relative_attention_bias", None)
        if bias is not None:
            start = rank * heads
            bias.register_forward_hook(lambda _m, _a, out, s=start, h=heads: out[..., s:s + h])
        setattr(module, TP_HEADS_ATTRIBUTE, (rank, tp_size))
        divided += 1
    return divided


def load_rank(model_class: type, folder: str, tp_size: int, rank: int, *, subfolder: str | None = None,
              torch_dtype: torch.dtype | None = None, **kwargs) -> nn.Module:
    """This rank's slice of ``model_class`` from ``folder``, through transformers' ``DistributedConfig``.

    The process group must already be initialized (the rank worker forms it on its own
    rendezvous); transformers then puts the shards on this rank's device (LOCAL_RANK).
    """
    from transformers.distributed import DistributedConfig

    config = model_class.config_class.from_pretrained(folder, subfolder=subfolder or "")
    plan = tp_plan_for(model_class.__name__, config)
    sub = {"subfolder": subfolder} if subfolder else {}
    model = model_class.from_pretrained(
        folder, distributed_config=DistributedConfig(tp_size=tp_size, tp_plan=plan.as_dict()),
        torch_dtype=torch_dtype, **sub, **kwargs)
    heads = divide_attention_heads(model, tp_size, rank)
    own_shards(model)
    logger.info("tensor parallel %s rank %d/%d: %d rules, %d attention modules at %d heads", model_class.__name__,
                rank, tp_size, len(plan.rules), heads, _first_heads(model))
    return model.eval()


def own_shards(model: nn.Module) -> int:
    """Give every DTensor shard that is a view of a larger storage its own allocation; returns the bytes freed.

    transformers 5.24 on CPU slices each loaded tensor without copying: a rank's half of the tiny
    Wan's 32.8 MB table kept the whole 32.8 MB storage alive. The DTensor object (and its global
    shape) stays; only its local tensor is replaced by a contiguous copy of the same values.
    """
    freed = 0
    for _, p in sharded_parameters(model):
        local = p.to_local()
        held, own = local.untyped_storage().nbytes(), local.numel() * local.element_size()
        if held > own:
            replace_local_tensor(p, local.contiguous().clone())
            freed += held - own
    if freed:
        logger.info("%s: %d B of whole tensors no longer held behind this rank's shards", type(model).__name__, freed)
    return freed


def _first_heads(model: nn.Module) -> int:
    return next((m.n_heads for m in model.modules() if getattr(m, TP_HEADS_ATTRIBUTE, None)), 0)


def _expanded(model: nn.Module, plan: TensorParallelPlan) -> dict[str, str]:
    """Concrete parameter and module names for the plan's patterns (as transformers expands them)."""
    rules = plan.as_dict()
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        style = rules.get(re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name))
        if style is None:
            continue
        for pname, _ in module.named_parameters(recurse=False):
            out[f"{name}.{pname}"] = style
        out[name] = style
    return out


def shard_in_place(model: nn.Module, mesh, plan: TensorParallelPlan) -> int:
    """Turn ``model``'s planned parameters into DTensors over ``mesh`` and hook the planned modules'
    forwards (works on ``meta``); returns how many parameters were sharded.

    For planning a rank's bytes without loading: ``meta`` parameters become DTensors whose local
    shard has this rank's shape, which is what every byte count of the engine reads. The values of
    a real model's shards are not its slices (the loader's job); its forward runs the collectives.
    """
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    made: dict[int, nn.Parameter] = {}  # original Parameter id -> its DTensor: a tied one is sharded once, re-tied
    for name, style in _expanded(model, plan).items():
        if name not in params:  # a module: its forward runs the style's collectives
            ALL_PARALLEL_STYLES[style].install_forward(modules[name], mesh)
            continue
        module_name, _, pname = name.rpartition(".")
        module = modules[module_name]
        original = id(params[name])
        if original in made:
            own_parameters(module)[pname] = made[original]
            continue
        ALL_PARALLEL_STYLES[style].shard_param(module, pname, mesh)
        made[original] = own_parameters(module)[pname]
    return len(made)


def shard_dit(model: nn.Module, mesh) -> int:
    """Shard a diffusers DiT over ``mesh`` with the plan diffusers ships on its class; returns how many
    parameters became DTensors. Every rank must hold the same weights first (loaded from one folder):
    each keeps its slice, the rest is freed."""
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs
    from torch.distributed.tensor.parallel import parallelize_module

    name = type(model).__name__
    plan = diffusers_compat.tp_plan_of(type(model))
    if name not in DIFFUSERS_TP_CLASSES or not plan:
        raise NoTensorParallelPlan(f"{name} has no diffusers tensor-parallel plan here; DiTs with one: "
                                   f"{sorted(DIFFUSERS_TP_CLASSES)}")
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    # diffusers' refusals: heads that do not divide, a quantized, offloaded or adapter-wrapped model.
    diffusers_compat.check_tp_supported(model, plan, heads, mesh.size())
    resolve_tp_shard_specs(model, plan, mesh.size())  # every planned split divides, before anything is sharded
    blocks = diffusers_compat.resolve_tp_plan(model, plan)
    for block, relative in blocks:
        parallelize_module(block, mesh, diffusers_compat.tp_styles(relative))
    freed = own_shards(model) if not any(p.is_meta for p in model.parameters()) else 0
    count = len(sharded_parameters(model))
    logger.info("tensor parallel %s rank %d/%d: diffusers' plan (%d rules) over %d blocks, %d parameters sharded, "
                "%d heads per rank, %d B of whole tensors freed", name, mesh.get_local_rank(), mesh.size(), len(plan),
                len(blocks), count, (heads or 0) // mesh.size(), freed)
    return count


def shard_planned(model: nn.Module, mesh) -> int:
    """``model`` sharded over ``mesh`` by its class's plan (ours for the T5 family, diffusers' for DiTs);
    for the planner, on ``meta``."""
    name = type(model).__name__
    if name in DIFFUSERS_TP_CLASSES:
        return shard_dit(model, mesh)
    return shard_in_place(model, mesh, tp_plan_for(name, model.config))


@contextlib.contextmanager
def planning_world(tp_size: int) -> Iterator[object]:
    """A fake process group of ``tp_size`` ranks in this process, as rank 0; yields its CPU mesh.

    For planning on ``meta`` only: torch's fake backend runs no collective, but DTensors made
    over its mesh hold rank 0's local shapes (the largest when a dimension does not divide).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise RuntimeError("planning_world needs a process without a process group (this one has one)")
    register_fake_backend()  # torch's own fake backend: no collective runs
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=tp_size)
    try:
        yield init_device_mesh("cpu", (tp_size,))
    finally:
        dist.destroy_process_group()


__all__ = [
    "DIFFUSERS_TP_CLASSES", "KNOWN_TP_PLANS", "HeadsDoNotDivide", "NoTensorParallelPlan", "TensorParallelPlan",
    "check_heads_divide", "classes_with_plans", "divide_attention_heads", "has_plan", "load_rank", "own_shards", "planning_world", "shard_dit", "shard_in_place",
    "shard_planned", "tp_plan_for",
]
