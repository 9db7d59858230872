"""LoRA adapters applied unmerged, per row of a forward, on Linears resident or streamed.

:func:`apply_lora` gives a model a :class:`LoraSet`: the adapters' A/B matrices on the device (LRU
under a byte budget), and a forward hook on every Linear an adapter targets. The hook only
delegates: inside ``LoraSet.rows(per_row)`` (around ONE forward) it adds to the Linear's output,
for each adapter the forward's rows use, ``scale * alpha / rank * (x[rows] A^T) B^T`` into those
rows (``index_add_``: rows without an adapter keep the base output bit for bit); outside it the
Linear's output is untouched. The base weights are never modified and the base matmul runs once
for the whole batch, so a batch of requests with different adapters (or none) streams each base
layer once.

Why a forward hook on the Linear and not on the streamed layer: the engine's hooks sit on the
layer (a block); they bind the block's parameters to its ring slot (or resident copy, or the FP8
landing's widened weights) before the block's forward and release them after it. A Linear inside
the block runs between the two, so its own forward hook sees the real input and the output of the
base weight however it arrived (resident, pinned, pageable, mapped, FP8), and needs no weight of
the base layer itself.

Rows: the Linear's input must have the forward's batch rows first (``[B, seq, in]`` or ``[B, in]``,
what Wan's and FLUX's transformers pass), or a row-major flattening of them (``[B * k, in]``, Wan
2.2's per-token timestep embedder): row ``i`` belongs to batch row ``i // k``. Any other first
dimension raises :class:`LoraError` naming the module (a Linear that folds the batch otherwise
cannot be routed per row). A ``[B, k, in]`` input whose rows are not the batch's cannot be told
apart from a batch-first one: no diffusers transformer we serve passes one to an adapted Linear.

Under block compile (``offload_core.compile``) the hook runs eagerly at a graph break around each
adapted Linear, for every forward once adapters are loaded: a new routing never recompiles, at the
price of one break per adapted Linear.

Not covered: Linears sharded over tensor-parallel ranks (``check_fits`` refuses a DTensor weight);
adapters do not stream with their layer (they stay on the device, within the budget).

Runs in the process that runs the model's forwards (a Denoiser replica), on the forward's thread;
the routing is per thread, so a forward on another thread is not routed by this one's ``rows``.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from offload_core.lora.adapter import LoraAdapter, LoraError, check_fits
from offload_core.lora.terms import GroupTerm, add_terms

logger = logging.getLogger(__name__)

_ATTRIBUTE = "_offload_lora_set"
RowChoice = tuple[str, float] | None


@dataclass(frozen=True)
class LoadedAdapter:
    """An adapter on the device, as the residency report shows it."""

    name: str
    nbytes: int  # device bytes of its A and B matrices (in each Linear's dtype)
    device: torch.device
    last_used: float  # wall-clock seconds (time.time()) of its last load or forward


class _OnDevice:
    """One adapter's matrices on the device, and its place in the LRU order."""

    def __init__(self, adapter: LoraAdapter, matrices: dict[str, tuple[torch.Tensor, torch.Tensor]], tick: int):
        self.adapter = adapter
        self.matrices = matrices
        self.nbytes = sum(a.nbytes + b.nbytes for a, b in matrices.values())
        self.tick = tick  # larger = used more recently
        self.last_used = time.time()


@dataclass(frozen=True)
class _Group:
    """The rows of one forward that use one adapter at one scale."""

    name: str
    # Its device matrices by module, held for the forward: an eviction meanwhile (another thread's
    # load) cannot take them from under it.
    matrices: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rows: torch.Tensor  # long, on the device: the batch rows
    scaling: float  # the request's scale x alpha / rank
    all_rows: bool  # every row of the forward: added without indexing


class _Routing:
    """One forward's routing: its row count and its groups."""

    def __init__(self, n_rows: int, groups: tuple[_Group, ...]):
        self.n_rows = n_rows
        self.groups = groups
        self._expanded: dict[tuple[int, int], torch.Tensor] = {}

    def rows_for(self, group_index: int, k: int) -> torch.Tensor:
        """The group's rows in an input whose batch rows were flattened ``k`` to one (k = 1: as given)."""
        rows = self.groups[group_index].rows
        if k == 1:
            return rows
        key = (group_index, k)
        if key not in self._expanded:
            self._expanded[key] = (rows[:, None] * k + torch.arange(k, device=rows.device)).reshape(-1)
        return self._expanded[key]


class _LinearHook:
    """The forward hook of one targeted Linear: adds the routed adapters' terms to its output."""

    def __init__(self, owner: LoraSet, module_name: str):
        self.owner = owner
        self.module_name = module_name

    # Opaque to dynamo: traced inside a compiled block (offload_core.compile), the routing read here
    # (a new object per forward, its scales, its rows) was guarded on and recompiled the block at each
    # new routing (tiny Wan: 9 graphs for 6 forwards). Disabled, it runs eagerly at a graph break
    # around each adapted Linear, whatever the routing.
    @torch.compiler.disable
    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor):
        routing = self.owner._routing()
        if routing is None:
            return None  # outside rows(): the Linear as it is
        x = args[0] if args else kwargs["input"]
        return self.owner._add_terms(self.module_name, routing, x, output)


class LoraSet:
    """The adapters of one model on one device: loaded under a byte budget, routed per forward row."""

    def __init__(self, model: nn.Module, device: torch.device, budget_bytes: int):
        self.model = model
        self.device = torch.device(device)
        self.budget_bytes = int(budget_bytes)
        self._known: dict[str, LoraAdapter] = {}  # every adapter loaded once: reloaded from here after eviction
        self._on_device: dict[str, _OnDevice] = {}
        self._in_use: dict[str, int] = {}  # adapter -> forwards routing it now (never evicted meanwhile)
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._ticks = itertools.count(1)
        self._local = threading.local()
        self._lock = threading.Lock()

    # -- loading ----------------------------------------------------------------------------------
    @property
    def device_bytes(self) -> int:
        """Bytes of every loaded adapter's matrices on the device (standing memory for the ledger)."""
        return sum(entry.nbytes for entry in self._on_device.values())

    def load(self, adapter: LoraAdapter) -> LoadedAdapter:
        """Check ``adapter`` against the model and copy it to the device, evicting LRU ones over budget.

        The host copy is kept: an adapter evicted under the budget is copied back when a forward
        names it again. A name already loaded with another adapter is replaced."""
        check_fits(adapter, self.model)
        with self._lock:
            self._known[adapter.name] = adapter
            self._install_hooks(adapter)
            return self._to_device(adapter.name, keep=frozenset())

    def loaded(self) -> tuple[LoadedAdapter, ...]:
        """The adapters on the device, most recently used first."""
        entries = sorted(self._on_device.values(), key=lambda e: -e.tick)
        return tuple(LoadedAdapter(e.adapter.name, e.nbytes, self.device, e.last_used) for e in entries)

    def known(self) -> tuple[str, ...]:
        """Every adapter name loaded once (on the device or evicted to its host copy)."""
        return tuple(self._known)

    def evict(self, name: str) -> None:
        """Drop ``name``'s device copy (its host copy stays: a later forward naming it reloads it)."""
        with self._lock:
            if name not in self._on_device:
                raise LoraError(f"LoRA adapter {name!r} is not on the device (loaded: {sorted(self._on_device)})")
            self._drop(name, "asked")

    def close(self) -> None:
        """Remove every hook and device copy: the model is as it was before :func:`apply_lora`."""
        with self._lock:
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()
            self._on_device.clear()
            self._known.clear()
            if getattr(self.model, _ATTRIBUTE, None) is self:
                delattr(self.model, _ATTRIBUTE)

    def _install_hooks(self, adapter: LoraAdapter) -> None:
        for module_name in adapter.weights:
            if module_name not in self._hooks:
                linear = self.model.get_submodule(module_name)
                self._hooks[module_name] = linear.register_forward_hook(_LinearHook(self, module_name),
                                                                        with_kwargs=True)

    def _to_device(self, name: str, keep: frozenset[str]) -> LoadedAdapter:
        """Copy a known adapter to the device (evicting LRU ones not in ``keep``); touch it if there."""
        adapter = self._known[name]
        entry = self._on_device.get(name)
        if entry is not None and entry.adapter is adapter:
            return self._touch(entry)
        if entry is not None:
            self._drop(name, "replaced")
        matrices = {}
        for module_name, (a, b) in adapter.weights.items():
            dtype = self.model.get_submodule(module_name).weight.dtype
            matrices[module_name] = (a.to(self.device, dtype, copy=True), b.to(self.device, dtype, copy=True))
        nbytes = sum(a.nbytes + b.nbytes for a, b in matrices.values())
        if nbytes > self.budget_bytes:
            raise LoraError(f"LoRA adapter {name!r} needs {nbytes} B on {self.device}, over the whole adapter "
                            f"budget of {self.budget_bytes} B")
        self._make_room(nbytes, keep | {name})
        entry = _OnDevice(adapter, matrices, next(self._ticks))
        self._on_device[name] = entry
        logger.info("LoRA adapter %r loaded on %s: %d modules, rank %d, %d B; adapters on the device %d B of "
                    "budget %d B", name, self.device, len(matrices), adapter.rank, nbytes, self.device_bytes,
                    self.budget_bytes)
        return self._touch(entry)

    def _make_room(self, nbytes: int, keep: frozenset[str]) -> None:
        while self.device_bytes + nbytes > self.budget_bytes:
            evictable = [e for n, e in self._on_device.items() if n not in keep and not self._in_use.get(n)]
            if not evictable:
                raise LoraError(f"LoRA adapters {sorted(keep)} need {nbytes} B more on {self.device}; the budget is "
                                f"{self.budget_bytes} B and {self.device_bytes} B are held by adapters this forward "
                                "uses")
            self._drop(min(evictable, key=lambda e: e.tick).adapter.name, "least recently used", nbytes)

    def _drop(self, name: str, why: str, wanted: int = 0) -> None:
        entry = self._on_device.pop(name)
        logger.info("LoRA adapter %r evicted from %s (%s): %d B freed for %d B wanted; adapters on the device %d B "
                    "of budget %d B", name, self.device, why, entry.nbytes, wanted, self.device_bytes,
                    self.budget_bytes)

    def _touch(self, entry: _OnDevice) -> LoadedAdapter:
        entry.tick, entry.last_used = next(self._ticks), time.time()
        return LoadedAdapter(entry.adapter.name, entry.nbytes, self.device, entry.last_used)

    # -- routing ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def rows(self, per_row: Sequence[RowChoice]) -> Iterator[None]:
        """Around ONE forward: batch row ``i`` uses adapter ``per_row[i]`` = (name, scale), or none (None).

        Adapters evicted under the budget are copied back first; an unknown name raises
        :class:`LoraError`. Not reentrant on one thread (one forward at a time)."""
        if self._routing() is not None:
            raise LoraError("LoraSet.rows is already active on this thread: one forward at a time")
        routing = self._plan(list(per_row))
        self._local.routing = routing
        try:
            yield
        finally:
            self._local.routing = None
            with self._lock:
                for group in routing.groups:
                    self._in_use[group.name] -= 1

    def _routing(self) -> _Routing | None:
        return getattr(self._local, "routing", None)

    def _plan(self, per_row: list[RowChoice]) -> _Routing:
        """Group the rows per (adapter, scale), with each adapter on the device."""
        grouped: dict[tuple[str, float], list[int]] = {}
        for row, choice in enumerate(per_row):
            if choice is not None:
                grouped.setdefault((choice[0], float(choice[1])), []).append(row)
        names = frozenset(name for name, _ in grouped)
        unknown = sorted(names - set(self._known))
        if unknown:
            raise LoraError(f"LoRA adapter {unknown[0]!r} is not loaded for {type(self.model).__name__} "
                            f"(loaded: {sorted(self._known)})")
        with self._lock:
            for name in sorted(names):
                self._to_device(name, keep=names)
            groups = tuple(_Group(name, self._on_device[name].matrices,
                                  torch.tensor(rows, dtype=torch.long, device=self.device),
                                  scale * self._known[name].scaling, len(rows) == len(per_row))
                           for (name, scale), rows in grouped.items())
            for group in groups:
                self._in_use[group.name] = self._in_use.get(group.name, 0) + 1
        return _Routing(len(per_row), groups)

    def _add_terms(self, module_name: str, routing: _Routing, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """``output`` plus each group's low-rank term in its rows (other rows untouched, bit for bit)."""
        targeting = [(index, group, group.matrices[module_name]) for index, group in enumerate(routing.groups)
                     if module_name in group.matrices]
        if not targeting:
            return output  # no adapter of this forward targets this Linear
        k = self._row_multiple(module_name, routing, x)
        for _, group, (a, _) in targeting:
            if x.device != a.device:
                raise LoraError(f"LoRA adapter {group.name!r}: module {module_name!r} ran on {x.device}, the "
                                f"adapter is on {a.device}")
        out = output if not output.requires_grad else output.clone()
        return add_terms(x, out, [GroupTerm(a, b, routing.rows_for(index, k), group.scaling, group.all_rows)
                                  for index, group, (a, b) in targeting])

    @staticmethod
    def _row_multiple(module_name: str, routing: _Routing, x: torch.Tensor) -> int:
        """How many input rows each batch row became (1: batch rows first, as given)."""
        n, first = routing.n_rows, x.shape[0] if x.dim() else 0
        if x.dim() < 2 or first % n:
            raise LoraError(f"LoRA on {module_name!r}: its input has shape {tuple(x.shape)}, but the forward has "
                            f"{n} batch rows; a routed Linear needs the batch rows first (or flattened row-major)")
        return first // n


def apply_lora(model: nn.Module, device: torch.device | str, budget_bytes: int) -> LoraSet:
    """Give ``model`` a :class:`LoraSet` on ``device`` holding at most ``budget_bytes`` of adapters.

    Works before or after :func:`offload_core.streaming.engine.apply_layer_streaming` (the hooks
    are on the Linears, inside the streamed layers). ``LoraSet.close()`` undoes it."""
    if getattr(model, _ATTRIBUTE, None) is not None:
        raise LoraError(f"{type(model).__name__} already has a LoraSet; close() it first")
    if budget_bytes <= 0:
        raise LoraError(f"LoRA budget must be positive, got {budget_bytes} B")
    lora_set = LoraSet(model, torch.device(device), budget_bytes)
    setattr(model, _ATTRIBUTE, lora_set)
    logger.info("LoRA on %s: adapters on %s within %d B", type(model).__name__, lora_set.device, budget_bytes)
    return lora_set
