"""A LoRA adapter on the host: read from a diffusers/PEFT safetensors file, and checked against a model.

:func:`load_lora` reads one adapter (a ``.safetensors`` file, or a folder holding diffusers'
``pytorch_lora_weights.safetensors`` or PEFT's ``adapter_model.safetensors`` with its
``adapter_config.json``) into a :class:`LoraAdapter`: per targeted Linear (by qualified name in
the model) its A ``[rank, in]`` and B ``[out, rank]``. :func:`check_fits` refuses an adapter whose
targets are not Linears of the model, or whose shapes or rank do not match, with a
:class:`LoraError` naming the adapter, the module and what mismatched: at deploy, not at step 12.

Only safetensors are read (no pickle). Pure torch (+ safetensors, imported when a file is read).
Runs where the adapters are loaded: a Denoiser replica at start, a test, a user's process.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from offload_core.tensor_parallel.sharded import is_sharded

logger = logging.getLogger(__name__)

# The files a folder may hold, in the order they are looked for: diffusers' save_lora_weights, PEFT's
# save_pretrained (and diffusers' save_lora_adapter).
ADAPTER_FILES = ("pytorch_lora_weights.safetensors", "adapter_model.safetensors")
PEFT_CONFIG = "adapter_config.json"
# PEFT's own prefix (``get_peft_model(...).save_pretrained``): stripped before module names are read.
_PEFT_PREFIX = "base_model.model."
# A key's end: which matrix it is. diffusers/PEFT (``lora_A``/``lora_B``, PEFT also with the adapter
# name ``default``) and the older ``lora.down``/``lora.up`` and kohya-like ``lora_down``/``lora_up``.
_MATRIX = re.compile(r"^(?P<module>.+?)\.(?:(?P<a>lora_A|lora\.down|lora_down)|(?P<b>lora_B|lora\.up|lora_up))"
                     r"(?:\.default)?\.weight$")
_ALPHA = re.compile(r"^(?P<module>.+?)\.alpha$")


class LoraError(ValueError):
    """An adapter that cannot be read or does not fit the model: names the adapter, the module, what mismatched."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter on the host: per targeted Linear, (A ``[rank, in]``, B ``[out, rank]``).

    ``scale``: the default strength (the config's); a request may name another. ``alpha``: PEFT's
    ``lora_alpha`` when the file gives one; the low-rank term is ``scale * alpha / rank * (x A^T) B^T``
    (``scale * (x A^T) B^T`` without alpha), as PEFT computes it.
    """

    name: str
    scale: float
    rank: int
    alpha: float | None
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    @property
    def scaling(self) -> float:
        """What a request's scale is multiplied by: ``alpha / rank`` (PEFT's ``scaling``), 1 without alpha."""
        return 1.0 if self.alpha is None else self.alpha / self.rank

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(self.weights)


def adapter_file(path: str | os.PathLike) -> pathlib.Path:
    """The safetensors file ``path`` names: itself, or the adapter file a folder holds."""
    path = pathlib.Path(path)
    if path.is_dir():
        for name in ADAPTER_FILES:
            if (path / name).is_file():
                return path / name
        found = sorted(path.glob("*.safetensors"))
        if len(found) == 1:
            return found[0]
        raise LoraError(f"LoRA folder {path} holds {len(found)} .safetensors files and none of {ADAPTER_FILES}: "
                        "name the file")
    if path.suffix != ".safetensors":
        raise LoraError(f"LoRA adapter {path}: only .safetensors files load (no pickle)")
    if not path.is_file():
        raise LoraError(f"LoRA adapter {path}: no such file")
    return path


def _peft_alpha(folder: pathlib.Path, name: str) -> float | None:
    """``lora_alpha`` from PEFT's adapter_config.json beside the file (None without one)."""
    config_path = folder / PEFT_CONFIG
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoraError(f"LoRA adapter {name!r}: {PEFT_CONFIG} has a {key} (per-module ranks or alphas), "
                            "which is not supported: one rank and one alpha per adapter")
    for key, what in (("use_rslora", "rank-stabilized scaling (alpha / sqrt(rank))"), ("use_dora", "DoRA")):
        if config.get(key):
            raise LoraError(f"LoRA adapter {name!r}: {PEFT_CONFIG} sets {key} ({what}), which is not supported")
    alpha = config.get("lora_alpha")
    return None if alpha is None else float(alpha)


def _strip(keys: Iterable[str], prefix: str | None) -> dict[str, str]:
    """Each key's name without PEFT's and the component's prefix; keys of other components dropped."""
    unpeft = {key: key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key for key in keys}
    if prefix:
        mine = {key: name[len(prefix) + 1:] for key, name in unpeft.items() if name.startswith(prefix + ".")}
        if mine:
            return mine  # a pipeline's file (text_encoder.* beside transformer.*): this component's keys
    return unpeft


def _pairs(name: str, tensors: Mapping[str, torch.Tensor], prefix: str | None,
           dtype: torch.dtype | None) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, float]]:
    """Per module (A, B) and any per-module ``alpha`` scalars, refusing half pairs and stray keys."""
    a_of: dict[str, torch.Tensor] = {}
    b_of: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    for key, stripped in _strip(tensors, prefix).items():
        matrix, alpha = _MATRIX.match(stripped), _ALPHA.match(stripped)
        if alpha:
            alphas[alpha["module"]] = float(tensors[key].float().item())
        elif matrix is None:
            raise LoraError(f"LoRA adapter {name!r}: key {key!r} is neither a lora_A/lora_B (lora.down/lora.up) "
                            "weight nor an alpha")
        else:
            tensor = tensors[key] if dtype is None else tensors[key].to(dtype)
            (a_of if matrix["a"] else b_of)[matrix["module"]] = tensor.contiguous()
    for module in sorted(set(a_of) ^ set(b_of)):
        raise LoraError(f"LoRA adapter {name!r}: module {module!r} has only its "
                        f"{'A (down)' if module in a_of else 'B (up)'} matrix")
    if not a_of:
        raise LoraError(f"LoRA adapter {name!r}: no lora_A/lora_B weights"
                        + (f" under the prefix {prefix!r}" if prefix else ""))
    return {module: (a_of[module], b_of[module]) for module in sorted(a_of)}, alphas


def _rank(name: str, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
    """The adapter's one rank; a module whose A and B disagree, or whose rank differs, is refused."""
    ranks = {}
    for module, (a, b) in weights.items():
        if a.dim() != 2 or b.dim() != 2:
            raise LoraError(f"LoRA adapter {name!r}: module {module!r} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}; a Linear's LoRA needs 2-D A [rank, in] and B [out, rank]")
        if a.shape[0] != b.shape[1]:
            raise LoraError(f"LoRA adapter {name!r}: module {module!r} has A of rank {a.shape[0]} but B of "
                            f"rank {b.shape[1]} (A {tuple(a.shape)}, B {tuple(b.shape)})")
        ranks[module] = a.shape[0]
    if len(set(ranks.values())) > 1:
        first = next(iter(ranks))
        other = next(m for m, r in ranks.items() if r != ranks[first])
        raise LoraError(f"LoRA adapter {name!r}: module {other!r} has rank {ranks[other]} but {first!r} has rank "
                        f"{ranks[first]}: one rank per adapter")
    return next(iter(ranks.values()))


def load_lora(path: str | os.PathLike, name: str, scale: float = 1.0, prefix: str | None = "transformer", *,
              dtype: torch.dtype | None = None) -> LoraAdapter:
    """Read the adapter at ``path`` (a .safetensors file or a folder holding one) as ``name``.

    ``prefix``: the component's key prefix in a pipeline's file (``transformer.blocks.0.attn1.to_q.lora_A.weight``);
    keys without it are read as they are when no key has it (a component's own file). ``dtype``: cast
    A and B (None: as stored; :meth:`LoraSet.load` casts to each Linear's dtype on the device anyway).
    ``alpha``: PEFT's ``lora_alpha`` (adapter_config.json), or the file's per-module ``.alpha`` keys
    when they all agree.
    """
    from safetensors.torch import load_file  # lazy: offload_core imports on torch alone

    file = adapter_file(path)
    try:
        tensors = load_file(str(file))
    except Exception as error:  # a corrupt or truncated file: the adapter's name and the reader's words
        raise LoraError(f"LoRA adapter {name!r}: {file} is not a readable safetensors file: {error}") from error
    weights, alphas = _pairs(name, tensors, prefix, dtype)
    rank = _rank(name, weights)
    alpha = _peft_alpha(file.parent, name)
    if alpha is None and alphas:
        if len(set(alphas.values())) > 1:
            raise LoraError(f"LoRA adapter {name!r}: its modules' alphas differ ({sorted(set(alphas.values()))}): "
                            "one alpha per adapter")
        alpha = next(iter(alphas.values()))
    adapter = LoraAdapter(name=name, scale=float(scale), rank=rank, alpha=alpha, weights=weights)
    logger.info("LoRA adapter %r read from %s: %d modules, rank %d, alpha %s, %d B", name, file.name,
                len(weights), rank, alpha, adapter.nbytes)
    return adapter


def check_fits(adapter: LoraAdapter, model: nn.Module) -> None:
    """Refuse ``adapter`` unless every target is an ``nn.Linear`` of ``model`` with A's in and B's out features."""
    modules = dict(model.named_modules())
    for module, (a, b) in adapter.weights.items():
        target = modules.get(module)
        if target is None:
            near = [m for m in modules if m.rsplit(".", 1)[-1] == module.rsplit(".", 1)[-1]][:3]
            raise LoraError(f"LoRA adapter {adapter.name!r}: module {module!r} is not in {type(model).__name__}"
                            + (f" (modules with that name: {near})" if near else ""))
        if not isinstance(target, nn.Linear):
            raise LoraError(f"LoRA adapter {adapter.name!r}: module {module!r} is a {type(target).__name__}, "
                            "not an nn.Linear (only Linear layers take a LoRA here)")
        if is_sharded(target.weight):
            raise LoraError(f"LoRA adapter {adapter.name!r}: module {module!r} is sharded over tensor-parallel "
                            "ranks (a DTensor weight); adapters apply to unsharded Linears only")
        if a.shape[0] != adapter.rank or b.shape[1] != adapter.rank:
            raise LoraError(f"LoRA adapter {adapter.name!r}: module {module!r} has rank {a.shape[0]}/{b.shape[1]}, "
                            f"the adapter's rank is {adapter.rank}")
        if a.shape[1] != target.in_features:
            raise LoraError(f"LoRA adapter {adapter.name!r}: module {module!r} takes {target.in_features} input "
                            f"features, the adapter's A is {tuple(a.shape)} (in {a.shape[1]})")
        if b.shape[0] != target.out_features:
            raise LoraError(f"LoRA adapter {adapter.name!r}: module {module!r} gives {target.out_features} output "
                            f"features, the adapter's B is {tuple(b.shape)} (out {b.shape[0]})")


def lora_flops(rank: int, linear_shapes: Sequence[tuple[int, int]], tokens: int) -> int:
    """Multiply-add FLOPs (2 per MAC) of one forward's low-rank terms over ``tokens`` rows.

    ``linear_shapes``: (in, out) of each adapted Linear, as many times as it runs per forward. Each adds
    ``tokens x (in x rank + rank x out)`` MACs; compare with the base ``tokens x in x out``
    (:func:`linear_flops`) for the term's share of a step.
    """
    return 2 * tokens * sum(rank * (fan_in + fan_out) for fan_in, fan_out in linear_shapes)


def linear_flops(linear_shapes: Sequence[tuple[int, int]], tokens: int) -> int:
    """The base Linears' FLOPs over ``tokens`` rows (2 per MAC), for :func:`lora_flops`' ratio."""
    return 2 * tokens * sum(fan_in * fan_out for fan_in, fan_out in linear_shapes)
