"""Host-resident embedding tables at run time: detached around device moves, gathered on the host.

Which tables qualify, and why, is decided in ``offload_core.tables`` (pure, shared with the
planner); this module keeps the chosen ones in host memory and gathers a prompt's rows there.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from torch import nn

from compat.torch import own_parameters
from offload_core.tables import HostTablesConfig, TableDecision, TableVerdict, select_host_tables
from offload_core.tensor_parallel.sharded import local_nbytes, move_unsharded, refuse_sharded

logger = logging.getLogger(__name__)


class HostTables:
    """The hosted tables of one model: detached around device moves, gathered on the host."""

    def __init__(self, model: nn.Module, decisions: tuple[TableDecision, ...]):
        self.model = model
        self.decisions = decisions
        self.hosted = tuple(d for d in decisions if d.verdict is TableVerdict.HOSTED)
        self._weights = {d.path: model.get_submodule(d.path).weight for d in self.hosted}
        refuse_sharded(self._weights.values(), "hosting a token table")
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self.device: torch.device | None = None

    def host_tensors(self) -> tuple[torch.Tensor, ...]:
        """The host tensors backing the hosted tables, for the residency report."""
        return tuple(w.data for w in self._weights.values())

    def is_hosted(self, param: torch.Tensor) -> bool:
        return any(param is w for w in self._weights.values())

    @contextlib.contextmanager
    def detached(self) -> Iterator[None]:
        """Take the hosted tables out of the model so a ``.to(device)`` inside leaves them alone."""
        for d in self.hosted:
            for path in d.module_paths:
                own_parameters(self.model.get_submodule(path))["weight"] = None
        try:
            yield
        finally:
            for d in self.hosted:
                for path in d.module_paths:
                    own_parameters(self.model.get_submodule(path))["weight"] = self._weights[d.path]

    def install(self, device: torch.device) -> None:
        """Route every holder's lookups through the host: ids in to the host, rows out to ``device``."""
        assert not self._hooks, "host-table hooks installed twice would copy the rows twice"
        self.device = torch.device(device)
        for d in self.hosted:
            host = self._weights[d.path].device
            for path in d.module_paths:
                module = self.model.get_submodule(path)
                self._hooks.append(module.register_forward_pre_hook(_ids_to(host)))
                self._hooks.append(module.register_forward_hook(_rows_to(self.device)))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _ids_to(host: torch.device):
    def pre_hook(module, args):
        return (args[0].to(host),) + tuple(args[1:])
    return pre_hook


def _rows_to(device: torch.device):
    def post_hook(module, args, output):
        # non_blocking: the gathered rows (8 MiB for a 512-token umT5 prompt) overlap what follows.
        return output.to(device, non_blocking=True)
    return post_hook


def apply_host_tables(model: nn.Module, device: torch.device | str,
                      config: HostTablesConfig = HostTablesConfig(), *, move: bool = True) -> HostTables:
    """Select ``model``'s host tables, install the host gathers and (if ``move``) move the rest to ``device``."""
    if config.min_bytes < 0:
        raise ValueError(f"min_bytes must be >= 0, got {config.min_bytes}")
    tables = HostTables(model, select_host_tables(model, config))
    if move:
        with tables.detached():
            move_unsharded(model, torch.device(device))
    tables.install(torch.device(device))
    return tables


def device_weight_bytes(model: nn.Module, tables: HostTables | None = None) -> int:
    """Bytes of the model's parameters and buffers that live on the device (hosted tables excluded)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or (tables is not None and tables.is_hosted(t)):
            continue
        seen.add(id(t))
        total += local_nbytes(t)  # a rank's shard of a tensor-parallel parameter
    return total
