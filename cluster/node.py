"""Facts about the node a replica runs on: host RAM, its GPUs, and its Ray identity.

GPUs are read through NVML (name, memory, PCIe generation and width). A machine without an NVIDIA
driver raises ``NVMLError`` at init; that is "no GPUs seen through NVML", said once in a log line,
never an exception. Tests (and several fake nodes on one machine) inject facts through the Ray
node's custom resources, read by :func:`injected_facts`:

* ``offload_fake_ram_gb``: the node's RAM total and available, in GB (10**9 bytes);
* ``GPU`` together with ``accelerator_type:<TYPE>``: that many GPUs of ``TYPE``, sized from the
  one GPU table (``offload_core.planner.gpus``).

Real NVML facts always win over injected ones.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

from offload_core.host.ram import HostRam, MemoryReading, host_ram_available
from offload_core.planner import gpus as gpu_table
from offload_core.planner.config_file import UnknownModel

logger = logging.getLogger(__name__)

GB = 10**9
FAKE_RAM_RESOURCE = "offload_fake_ram_gb"
_NO_PROC = "/nonexistent/offload-serve/injected-node"
ACCELERATOR_PREFIX = "accelerator_type:"


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as the driver (or an injected fact) describes it."""

    index: int
    name: str
    memory_bytes: int
    pcie_gen: int | None  # None when unknown (injected facts without a link line)
    pcie_width: int | None
    source: str  # "nvml" or "injected:<where from>"
    # NVML's "GPU-..." (a card) or "MIG-..." (a MIG instance: memory is the instance's, not the card's);
    # None for injected facts. CUDA_VISIBLE_DEVICES and Ray's GPU ids may name a GPU by it.
    uuid: str | None = None


@dataclass(frozen=True)
class NodeInfo:
    node_id: str | None  # Ray node id (hex); None without Ray
    ram: HostRam  # spendable = min(available, cgroup headroom) - reserve - Ray's object store
    ram_injected: bool  # True when the RAM facts came from the node's offload_fake_ram_gb
    gpus: tuple[GpuInfo, ...]
    accelerator_type: str | None  # Ray's accelerator_type of this node, if it has one
    object_store_bytes: int  # Ray's object store on this node (0 without Ray)


def fake_gpus(accelerator_type: str, count: int, source: str) -> tuple[GpuInfo, ...]:
    """``count`` GPUs of a type named in the GPU table (tests, CPU-only nodes standing in for GPUs)."""
    try:
        model = gpu_table.gpu_model(accelerator_type)
    except UnknownModel:
        raise ValueError(f"unknown GPU type {accelerator_type!r}; known: {sorted(gpu_table.gpu_names())}") from None
    return tuple(GpuInfo(i, model.name, model.memory_bytes, model.pcie_gen, model.pcie_width, source)
                 for i in range(count))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _mig_instances(nvml, handle) -> list:
    """The MIG instance handles of a card in MIG mode; [] for a card that is not (or cannot be)."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:  # not MIG-capable
        return []
    if current != nvml.NVML_DEVICE_MIG_ENABLE:
        return []
    instances = []
    for j in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            instances.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j))
        except nvml.NVMLError:  # an empty slot
            continue
    return instances


def probe_nvml_gpus(nvml=None) -> tuple[GpuInfo, ...]:
    """Every GPU NVML sees, or () when there is no NVIDIA driver (said once, at INFO).

    A card in MIG mode is listed as its MIG instances, each with its own memory and "MIG-" UUID
    (the card's total would let replicas on one instance plan for memory they cannot have); the
    instances are numbered after the cards. ``nvml`` is injectable for tests (default: pynvml).
    """
    if nvml is None:
        import pynvml as nvml

    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        logger.info("no GPUs seen through NVML (%s): node has no NVIDIA driver", exc)
        return ()
    try:
        count = nvml.nvmlDeviceGetCount()
        cards, migs = [], []
        for i in range(count):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            name = _text(nvml.nvmlDeviceGetName(handle))
            try:
                gen = int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))
                width = int(nvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
            except nvml.NVMLError as exc:  # SXM boards without a PCIe link report NotSupported
                logger.info("GPU %d (%s): PCIe link not reported by NVML (%s)", i, name, exc)
                gen = width = None
            instances = _mig_instances(nvml, handle)
            if not instances:
                cards.append(GpuInfo(i, name, int(nvml.nvmlDeviceGetMemoryInfo(handle).total), gen, width, "nvml",
                                      _text(nvml.nvmlDeviceGetUUID(handle))))
                continue
            logger.info("GPU %d (%s) is in MIG mode: its %d instance(s) are listed in its place", i, name,
                        len(instances))
            for mig in instances:
                migs.append(GpuInfo(count + len(migs), _text(nvml.nvmlDeviceGetName(mig)),
                                     int(nvml.nvmlDeviceGetMemoryInfo(mig).total), gen, width, "nvml:mig",
                                     _text(nvml.nvmlDeviceGetUUID(mig))))
        return tuple(cards + migs)
    finally:
        nvml.nvmlShutdown()


def visible_gpu_indices(ids, gpus: tuple[GpuInfo, ...]) -> list[int]:
    """Indices (in ``gpus``) of the GPUs named by ``ids``: Ray's GPU ids or CUDA_VISIBLE_DEVICES'
    entries, each a number (the card's NVML index) or a "GPU-"/"MIG-" UUID (a prefix is enough, as
    for CUDA). Unknown names are an error naming what the node has."""
    indices = []
    for raw in ids:
        name = str(raw).strip()
        if name.isdigit():
            match = [g for g in gpus if g.index == int(name) and not g.source.endswith(":mig")]
        else:
            match = [g for g in gpus if g.uuid is not None and g.uuid.startswith(name)]
        if len(match) != 1:
            raise LookupError(f"GPU {name!r} matches {len(match)} of this node's GPUs: "
                              f"{[(g.index, g.uuid) for g in gpus]}")
        indices.append(match[0].index)
    return indices


def cuda_visible_ids(environ=None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of names; None when unset (every GPU is visible)."""
    import os

    value = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [part for part in (p.strip() for p in value.split(",")) if part]


def probe_host_ram(reserve: int | None = None, reserved_elsewhere: int = 0,
                   injected_bytes: int | None = None) -> HostRam:
    """offload_core's spendable host RAM: min(available, cgroup headroom) - reserve - elsewhere.

    ``injected_bytes`` stands for a whole (fake) node's RAM, total and available; no cgroup of
    this process applies to it, so the cgroup walk is pointed at no /proc.
    """
    if injected_bytes is None:
        return host_ram_available(reserve, reserved_elsewhere)
    return host_ram_available(reserve, reserved_elsewhere, proc_root=_NO_PROC,
                              memory_facts=lambda: MemoryReading(injected_bytes, injected_bytes))


def injected_facts(resources: Mapping[str, float]) -> tuple[int | None, tuple[GpuInfo, ...]]:
    """RAM bytes and GPUs a test put on a Ray node as custom resources (see the module doc)."""
    ram = int(resources[FAKE_RAM_RESOURCE] * GB) if FAKE_RAM_RESOURCE in resources else None
    types = [k[len(ACCELERATOR_PREFIX):] for k in resources if k.startswith(ACCELERATOR_PREFIX)]
    count = int(resources.get("GPU", 0))
    gpus: tuple[GpuInfo, ...] = ()
    if types and count:
        gpus = fake_gpus(types[0], count, f"injected:{ACCELERATOR_PREFIX}{types[0]}")
    return ram, gpus


def ray_node_resources(node_id: str) -> Mapping[str, float]:
    """Total resources of one live Ray node (its custom resources included)."""
    import ray

    for node in ray.nodes():
        if node["NodeID"] == node_id and node["Alive"]:
            return dict(node["Resources"])
    raise LookupError(f"Ray node {node_id} is not alive")


def probe_node(node_id: str | None = None, resources: Mapping[str, float] | None = None,
               nvml_gpus: tuple[GpuInfo, ...] | None = None, reserve: int | None = None) -> NodeInfo:
    """Facts of this node. With Ray up, ``node_id`` defaults to the caller's node.

    ``nvml_gpus`` and ``resources`` are injectable for tests; by default they are probed.
    ``reserve`` is kept out of the spendable RAM (None: offload_core's default, max(5 %, 2 GiB)).
    """
    if resources is None and node_id is None:
        import ray

        if ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id()
    if resources is None:
        resources = ray_node_resources(node_id) if node_id else {}
    gpus = probe_nvml_gpus() if nvml_gpus is None else nvml_gpus
    fake_ram, fake = injected_facts(resources)
    if not gpus and fake:
        logger.info("node %s: %d GPU(s) of type %s from node resources (no NVML GPUs)",
                    node_id, len(fake), fake[0].name)
        gpus = fake
    store = int(resources.get("object_store_memory", 0))
    ram = probe_host_ram(reserve, store, fake_ram)
    types = [k[len(ACCELERATOR_PREFIX):] for k in resources if k.startswith(ACCELERATOR_PREFIX)]
    facts = NodeInfo(node_id, ram, fake_ram is not None, gpus, types[0] if types else None, store)
    logger.info("node %s: RAM %.2f GB spendable of %.2f GB available (%s, reserve %.2f, object store %.2f); "
                "GPUs: %s", node_id, ram.spendable / GB, ram.psutil_available / GB,
                "injected" if fake_ram is not None else ram.bound.value, ram.reserve / GB, store / GB,
                ", ".join(f"{g.index}:{g.name} {g.memory_bytes / GB:.0f} GB Gen{g.pcie_gen}x{g.pcie_width}"
                          for g in gpus) or "none")
    return facts
