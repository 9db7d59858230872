"""The one table of GPU facts: memory, host link and compute rate per GPU model.

Read from the ``gpus`` table of configs/models/real_model_configs.json, the only place these
numbers are written. The plan CLI (``planner.inputs``), the cluster's node facts (fake GPUs of a
type, a replica's link) and the service's configured link all ask here.

Memory is in GiB: an "80 GB" H100 reports 81559 MiB (79.6 GiB) through NVML and a "24 GB" L4
23034 MiB (22.5 GiB), so the nominal figure read as GiB is, as the table says, a little above
what the driver reports.

Runs in whichever process plans: ``offload-serve plan`` and each stage replica (through ``cluster/replica/plan.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

from offload_core.planner.config_file import config_file, resolve_name

GiB = 1024**3
# Ray's accelerator_type names that differ from the table's keys.
RAY_TYPE_ALIASES = {"A100-80G": "A100-80GB", "A100-40G": "A100-40GB"}
# Without link facts (a CPU-only node, a driver that does not report the link): PCIe Gen4 x16,
# the common case in the fleet (every card in the table but H100/H200).
DEFAULT_PCIE = (4, 16)


@dataclass(frozen=True)
class GpuModel:
    """One GPU model as the table describes it."""

    name: str  # the table's key, e.g. "L4"; also the fleet's Ray accelerator_type
    memory_gb: int  # nominal, read as GiB (see the module docstring)
    memory_bytes: int
    link: str  # "PCIe Gen4 x16"
    pcie_gen: int | None
    pcie_width: int | None
    pinned_Bps: float  # host->device from page-locked memory over its link
    dense_bf16_flops: float  # vendor dense BF16 tensor-core rate (no sparsity), FLOP/s


def parse_link(text: str) -> tuple[int | None, int | None]:
    """'PCIe Gen4 x16 (SXM: ...)' -> (4, 16); (None, None) for what does not say."""
    gen = width = None
    for token in text.replace("(", " ").split():
        if token.lower().startswith("gen") and token[3:].isdigit():
            gen = int(token[3:])
        elif token.lower().startswith("x") and token[1:].isdigit():
            width = int(token[1:])
    return gen, width


def link_Bps(pcie_gen: int | None = None, pcie_width: int | None = None) -> tuple[float, float]:
    """(pinned, pageable) host->device bytes per second over a PCIe link.

    Pinned: the table's measured figure for the generation at x16, scaled by lanes; a generation
    not measured scales from the nearest measured one (each PCIe generation doubles the lane
    rate). Pageable: the measured figure whatever the link; the host's own memcpy into the
    driver's staging buffer is the bottleneck, not the link.
    """
    gen = pcie_gen or DEFAULT_PCIE[0]
    width = pcie_width or DEFAULT_PCIE[1]
    measured = {parse_link(k)[0]: float(v) * 1e9
                for k, v in config_file()["host_to_device_bandwidth_measured_pinned_GBps"].items()
                if not k.startswith("_")}
    nearest = min(measured, key=lambda g: (abs(g - gen), -g))
    pinned = measured[nearest] * 2.0 ** (gen - nearest) * width / 16
    return pinned, float(config_file()["host_to_device_bandwidth_measured_pageable_GBps"]) * 1e9


def gpu_names() -> tuple[str, ...]:
    """The GPU models in the table."""
    return tuple(k for k in config_file()["gpus"] if not k.startswith("_"))


def gpu_model(name: str) -> GpuModel:
    """The table's facts of ``name`` (a table key, or Ray's accelerator_type for it)."""
    key = resolve_name(RAY_TYPE_ALIASES.get(name, name), gpu_names(), "GPU")
    entry = config_file()["gpus"][key]
    gen, width = parse_link(entry["link"])
    return GpuModel(key, int(entry["memory_gb"]), int(entry["memory_gb"]) * GiB, entry["link"], gen, width,
                    link_Bps(gen, width)[0], float(entry["dense_bf16_tflops"]) * 1e12)


__all__ = ["DEFAULT_PCIE", "GpuModel", "RAY_TYPE_ALIASES", "gpu_model", "gpu_names", "link_Bps", "parse_link"]
