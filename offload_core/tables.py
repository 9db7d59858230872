"""Which embedding tables stay on the host: declarations, the rules, and one decision per table.

Pure selection (works on ``meta`` models), shared by the planner and the runtime in
``offload_core.residency.host_tables``.

umT5-XXL's token table is 256384 x 4096 fp32 = 3.91 GiB, yet a 512-token prompt reads 8 MiB of
it. Keeping the table on the host and gathering the prompt's rows there saves the whole table's
device bytes for the price of one small copy of the gathered rows per call.

Opt-in only: a model class declares ``host_resident_table_names`` (dotted module paths), and
classes we cannot edit are listed in :data:`KNOWN_HOST_TABLES`. Undeclared models are never
touched. A table tied to anything but embeddings (an output head) is never hosted, and a
tensor-parallel sharded table stays on the device so the all-reduce it feeds sees device tensors.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch
from torch import nn

from compat.torch import own_parameters
from offload_core.tensor_parallel.sharded import is_sharded, local_nbytes, local_tensor

logger = logging.getLogger(__name__)

# 256 MiB: below this a table costs less device memory than one streamed layer of the models we
# serve (a Wan2.1-14B block is ~1.3 GiB fp32), so hosting it buys nothing worth a host gather.
DEFAULT_MIN_TABLE_BYTES = 256 * 1024 * 1024

# Classes we cannot edit. transformers 5.x names the token table ``shared`` and ties
# ``encoder.embed_tokens`` to the same Parameter; the tie is followed, so one path is enough.
KNOWN_HOST_TABLES: dict[str, tuple[str, ...]] = {
    "UMT5EncoderModel": ("shared",),
    "T5EncoderModel": ("shared",),
}


class TableVerdict(enum.Enum):
    HOSTED = "hosted"  # stays on the host; gathers run there
    MISSING = "missing"  # the declared path names no module
    NOT_EMBEDDING = "not_embedding"  # the path names a module without a 2-D ``weight``
    TOO_SMALL = "too_small"  # under the threshold: not worth a host gather
    SHARDED = "sharded"  # tensor-parallel: its all-reduce needs device tensors
    TIED_TO_HEAD = "tied_to_head"  # shared with a non-embedding module (an output projection)


@dataclass(frozen=True)
class HostTablesConfig:
    """Which tables to consider and how large they must be to be hosted."""

    min_bytes: int = DEFAULT_MIN_TABLE_BYTES
    # None: the model's declared names (class attribute or KNOWN_HOST_TABLES).
    names: tuple[str, ...] | None = None


@dataclass(frozen=True)
class TableDecision:
    """What happened to one declared table, with the numbers that decided it."""

    path: str
    verdict: TableVerdict
    nbytes: int
    # Every module path holding the same Parameter (ties), in model order.
    module_paths: tuple[str, ...]
    reason: str


def declared_table_names(model: nn.Module) -> tuple[str, ...]:
    """The model's opt-in table paths: its class attribute, else the known-class map, else none."""
    declared = getattr(type(model), "host_resident_table_names", None)
    if declared is not None:
        return tuple(declared)
    return KNOWN_HOST_TABLES.get(type(model).__name__, ())


def _is_sharded(module: nn.Module, weight: torch.Tensor, model: nn.Module) -> bool:
    # transformers models carry ``tp_size = None`` when not parallelized: None means unsharded.
    tp_size = getattr(module, "tp_size", None) or getattr(model, "tp_size", None) or 1
    return is_sharded(weight) or int(tp_size) != 1


def _holders(model: nn.Module, weight: nn.Parameter) -> list[tuple[str, nn.Module]]:
    return [(name, mod) for name, mod in model.named_modules(remove_duplicate=False)
            if any(p is weight for p in own_parameters(mod).values())]


def _decide(model: nn.Module, path: str, config: HostTablesConfig) -> TableDecision:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return TableDecision(path, TableVerdict.MISSING, 0, (), f"{type(model).__name__} has no module {path!r}")
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return TableDecision(path, TableVerdict.NOT_EMBEDDING, 0, (), f"{path} has no 2-D weight")
    nbytes = local_nbytes(weight)  # what this rank holds: half the table at tp 2
    holders = _holders(model, weight)
    paths = tuple(dict.fromkeys(name for name, _ in holders))
    if _is_sharded(module, weight, model):
        return TableDecision(path, TableVerdict.SHARDED, nbytes, paths,
                             f"{path} is tensor-parallel sharded ({tuple(local_tensor(weight).shape)} of "
                             f"{tuple(weight.shape)} on this rank, {nbytes} B); kept on the device: the all-reduce "
                             "of its partial lookups needs device tensors")
    heads = [name for name, mod in holders if not isinstance(mod, nn.Embedding)]
    if heads:
        return TableDecision(path, TableVerdict.TIED_TO_HEAD, nbytes, paths,
                             f"{path} is tied to non-embedding module(s) {heads}")
    if nbytes < config.min_bytes:
        return TableDecision(path, TableVerdict.TOO_SMALL, nbytes, paths,
                             f"{path} is {nbytes} B < threshold {config.min_bytes} B")
    return TableDecision(path, TableVerdict.HOSTED, nbytes, paths,
                         f"{path} ({tuple(weight.shape)}, {nbytes} B >= {config.min_bytes} B) gathered on the host")


def select_host_tables(model: nn.Module, config: HostTablesConfig = HostTablesConfig()) -> tuple[TableDecision, ...]:
    """Decide every declared table of ``model``; works on meta models (shapes and dtypes only)."""
    names = config.names if config.names is not None else declared_table_names(model)
    decisions: list[TableDecision] = []
    seen: set[str] = set()
    for path in names:
        decision = _decide(model, path, config)
        if seen.intersection(decision.module_paths):  # a tie declared twice is one table
            continue
        seen.update(decision.module_paths)
        decisions.append(decision)
        logger.info("host table %s.%s: %s (%s)", type(model).__name__, path, decision.verdict.value, decision.reason)
    return tuple(decisions)
