"""The checks of ``offload-serve doctor``: this machine's facts against what a Serve config needs.

Run in the user's shell (``offload-serve doctor``, and ``make demo`` before it starts Ray). Each
check is a small function of (what the config needs, what the machine has) returning one frozen
:class:`Check`; the machine's facts come in as a frozen :class:`Machine`, so tests simulate a
locked-memory limit, a small ``/dev/shm``, RAM, cgroups or GPUs without having them. Probing the
machine imports neither torch nor Ray: pynvml, psutil and a few files (about 0.2 s).
"""
from __future__ import annotations

import enum
import importlib.util
import os
import re
import resource
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from cluster.fleet import profile_for_gpu
from cluster.node import GpuInfo
from deployments.dev import local_ray
from deployments.dev.doctor_config import ConfigNeeds
from offload_core.host.budget_cap import format_bytes
from offload_core.host.ram import HostRam, host_ram_available

SHM = Path("/dev/shm")  # Ray's object store and the node weight stores live here (a tmpfs: RAM)
# Another process holding more than this share of a GPU's memory is worth a line: replicas plan
# within what is free, so they stream more than they would on an idle card.
GPU_BUSY_FRACTION = 0.10


class Status(enum.Enum):
    OK = "OK"
    WARN = "WARN"  # works, but slower or less safe than it could be; the fix says how
    FAIL = "FAIL"  # a blocker: start-up would fail, or run without what the config asks for


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    found: str
    fix: str = ""


@dataclass(frozen=True)
class GpuSeen:
    index: int
    name: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class Gpus:
    """What NVML reports; ``error`` says why nothing was seen (no driver), None when NVML answered."""

    seen: tuple[GpuSeen, ...] = ()
    driver: str | None = None
    cuda: tuple[int, int] | None = None  # the newest CUDA the driver supports
    error: str | None = None


@dataclass(frozen=True)
class Shm:
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class Machine:
    """The facts the checks compare against; :func:`probe_machine` reads this machine's."""

    memlock_bytes: int | None  # the soft RLIMIT_MEMLOCK (`ulimit -l`) in bytes; None: unlimited
    shm: Shm | None  # /dev/shm; None: there is none
    ram: HostRam  # offload_core.host.ram's figure: psutil, the cgroup chain, the reserve
    gpus: Gpus
    torch_cuda: tuple[int, int] | None  # the CUDA the installed torch was built for; None: a CPU build
    env: Mapping[str, str] = field(default_factory=dict)


def probe_gpus(nvml=None) -> Gpus:
    """Every GPU NVML sees with its free memory, the driver and its CUDA version (pynvml injectable)."""
    if nvml is None:
        import pynvml as nvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return Gpus(error=str(exc))
    try:
        seen = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            name = nvml.nvmlDeviceGetName(handle)
            seen.append(GpuSeen(i, name.decode() if isinstance(name, bytes) else name, int(memory.total),
                                int(memory.free)))
        driver = nvml.nvmlSystemGetDriverVersion()
        cuda = int(nvml.nvmlSystemGetCudaDriverVersion())  # e.g. 12080 for 12.8
        return Gpus(tuple(seen), driver.decode() if isinstance(driver, bytes) else driver,
                    (cuda // 1000, cuda % 1000 // 10))
    finally:
        nvml.nvmlShutdown()


def torch_cuda_version() -> tuple[int, int] | None:
    """The CUDA version torch was built for, read from torch/version.py without importing torch (2 s)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    text = (Path(spec.submodule_search_locations[0]) / "version.py").read_text()
    match = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"](\d+)\.(\d+)", text, re.MULTILINE)
    return (int(match.group(1)), int(match.group(2))) if match else None


def probe_machine(object_store_bytes: int, nvml=None) -> Machine:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    shm = shutil.disk_usage(SHM) if SHM.is_dir() else None
    return Machine(
        memlock_bytes=None if soft == resource.RLIM_INFINITY else soft,
        shm=Shm(shm.total, shm.free) if shm else None,
        # As the node ledger counts it: Ray's object store is promised to Ray, not to replicas.
        ram=host_ram_available(reserved_elsewhere=object_store_bytes),
        gpus=probe_gpus(nvml),
        torch_cuda=torch_cuda_version(),
        env=dict(os.environ))


def _size(nbytes: int | None) -> str:
    return "unlimited" if nbytes is None else format_bytes(nbytes)


def _version(v: tuple[int, int] | None) -> str:
    return "none" if v is None else f"{v[0]}.{v[1]}"


def check_gpus(needs: ConfigNeeds, machine: Machine) -> Check:
    gpus = machine.gpus
    found = "; ".join(f"{g.index}: {g.name}, {_size(g.free_bytes)} free of {_size(g.total_bytes)}" for g in gpus.seen)
    if not found:
        found = f"none (NVML: {gpus.error})" if gpus.error else "none"
    wanted = needs.gpus_needed()
    if wanted == 0:
        return Check("GPUs", Status.OK, f"{found}; the config asks for none")
    if len(gpus.seen) < wanted:
        return Check("GPUs", Status.FAIL, f"{found}; the config asks for {wanted:g} ({needs.describe_gpu_stages()})",
                     "run it on a machine with the GPUs and NVIDIA's driver, or serve the CPU config "
                     "(configs/local.yaml)")
    busy = [g for g in gpus.seen if g.total_bytes - g.free_bytes > GPU_BUSY_FRACTION * g.total_bytes]
    if busy:
        return Check("GPUs", Status.WARN, f"{found}; another process holds memory on GPU "
                     f"{', '.join(str(g.index) for g in busy)}",
                     "replicas plan within what is free and stream more; free the GPU for the fastest plans")
    return Check("GPUs", Status.OK, f"{found}; the config asks for {wanted:g}")


def check_driver(needs: ConfigNeeds, machine: Machine) -> Check:
    gpus, built = machine.gpus, machine.torch_cuda
    torch = "torch's CPU build" if built is None else f"torch built for CUDA {_version(built)}"
    found = f"driver {gpus.driver} (CUDA {_version(gpus.cuda)}), {torch}" if gpus.driver else f"no NVIDIA driver, {torch}"
    if needs.gpus_needed() == 0:
        return Check("driver and CUDA", Status.OK, f"{found}; not needed")
    if built is None:
        return Check("driver and CUDA", Status.FAIL, found + ": it cannot use a GPU",
                     "install torch's CUDA build: rm -rf .venv && make demo (the Makefile picks it when "
                     "nvidia-smi is found)")
    if gpus.cuda is None:
        return Check("driver and CUDA", Status.FAIL, found, "install NVIDIA's driver for the GPUs")
    if gpus.cuda[0] < built[0]:
        return Check("driver and CUDA", Status.FAIL, found + ": the driver is a major CUDA version behind torch",
                     f"update the NVIDIA driver to one for CUDA {_version(built)}, or install a torch built for "
                     f"CUDA {gpus.cuda[0]}.x")
    if gpus.cuda < built:
        return Check("driver and CUDA", Status.WARN, found + ": an older minor version (CUDA's minor-version "
                     "compatibility runs it; kernels that need the newer driver do not)",
                     f"update the NVIDIA driver to one for CUDA {_version(built)}")
    return Check("driver and CUDA", Status.OK, found)


def pin_budget(needs: ConfigNeeds, machine: Machine) -> tuple[int, str] | None:
    """The most one GPU replica may page-lock, and which stage: min(its host budget, its fleet
    profile's pin cap of spendable RAM), as cluster/replica/plan.py caps it. None: no GPU stage."""
    gpu = machine.gpus.seen[0] if machine.gpus.seen else None
    facts = None if gpu is None else GpuInfo(gpu.index, gpu.name, gpu.total_bytes, None, None, "nvml")
    cap = int(machine.ram.spendable * profile_for_gpu(facts).host_pin_cap_fraction)
    budgets = [(min(cap, s.host_budget.resolve(machine.ram.spendable)) if s.host_budget else cap, s.deployment)
               for s in needs.stages if s.gpus_per_replica > 0]
    return max(budgets, key=lambda b: b[0], default=None)  # the first stage of the largest


def check_memlock(needs: ConfigNeeds, machine: Machine) -> Check:
    limit = machine.memlock_bytes
    found = f"ulimit -l {'unlimited' if limit is None else limit // 1024} ({_size(limit)})"
    budget = pin_budget(needs, machine)
    if budget is None:
        return Check("locked memory", Status.OK, f"{found}; nothing is pinned: no stage uses a GPU")
    nbytes, stage = budget
    if limit is not None and limit < nbytes:
        return Check("locked memory", Status.FAIL,
                     f"{found} < the {_size(nbytes)} a {stage} replica may pin: its layers would stay pageable "
                     "(synchronous copies, several times slower)",
                     "raise it where Ray starts: `ulimit -l unlimited` (hard limit permitting), memlock in "
                     "/etc/security/limits.conf, or `docker run --ulimit memlock=-1`")
    return Check("locked memory", Status.OK, f"{found} >= the {_size(nbytes)} a {stage} replica may pin")


def check_shm(needs: ConfigNeeds, machine: Machine) -> Check:
    store = needs.object_store_bytes
    if machine.shm is None:
        return Check("/dev/shm", Status.FAIL, f"no /dev/shm for Ray's {_size(store)} object store",
                     "mount a tmpfs at /dev/shm (docker run --shm-size, or a Memory emptyDir on Kubernetes)")
    found = f"{_size(machine.shm.free_bytes)} free of {_size(machine.shm.total_bytes)}"
    if machine.shm.free_bytes < store:
        return Check("/dev/shm", Status.FAIL, f"{found} < Ray's {_size(store)} object store (Ray would fall back "
                     "to /tmp, on disk; the node weight stores would not fit)",
                     f"give /dev/shm at least {_size(store)} more: `docker run --shm-size=...`, "
                     "`mount -o remount,size=... /dev/shm`, or a larger Memory emptyDir on Kubernetes")
    return Check("/dev/shm", Status.OK, f"{found} >= Ray's {_size(store)} object store")


def check_host_ram(needs: ConfigNeeds, machine: Machine) -> Check:
    ram = machine.ram
    bound = (f"bound by cgroup v{ram.cgroup.version} {ram.cgroup.path}: limit {_size(ram.cgroup.limit)}"
             if ram.bound.value.startswith("cgroup") else "no tighter cgroup limit")
    found = (f"{_size(ram.spendable)} spendable of {_size(ram.total)} ({_size(ram.psutil_available)} available, "
             f"{bound}; less the {_size(ram.reserve)} reserve and the {_size(ram.reserved_elsewhere)} object store)")
    asked = [(s.host_budget.resolve(ram.spendable), s) for s in needs.stages if s.host_budget is not None]
    if ram.spendable == 0:
        return Check("host RAM", Status.FAIL, found + ": nothing left for the replicas' weights",
                     "free memory, or raise the container's memory limit")
    too_big = [(n, s) for n, s in asked if n > ram.spendable]
    if too_big:
        n, s = max(too_big, key=lambda t: t[0])
        return Check("host RAM", Status.FAIL, f"{found}; {s.deployment} asks for {_size(n)} per replica",
                     f"lower {s.deployment}'s host_memory_budget to at most {_size(ram.spendable)}, or run it "
                     "on a machine (or container limit) with more RAM")
    total = sum(n * s.max_replicas for n, s in asked)
    if total > ram.spendable:
        return Check("host RAM", Status.WARN, f"{found}; the budgets at max replicas ask for {_size(total)}",
                     "replicas started last plan within what the node ledger has left (more streaming); lower "
                     "host_memory_budget or max_replicas, or add RAM")
    return Check("host RAM", Status.OK, found + (f"; budgets at max replicas: {_size(total)}" if asked else
                                                 "; no per-replica host budget set"))


def check_ray_token(machine: Machine, creates_token: bool = False) -> Check:
    env = machine.env
    path = local_ray.token_path(dict(env))
    if env.get("RAY_AUTH_MODE", "token") != "token":
        return Check("Ray token", Status.WARN, f"RAY_AUTH_MODE={env['RAY_AUTH_MODE']} in this shell: a Ray you "
                     "start by hand would accept anyone on its ports", "unset RAY_AUTH_MODE (offload-serve "
                     "serve and make demo set token mode themselves)")
    if env.get("RAY_AUTH_TOKEN"):
        return Check("Ray token", Status.OK, "RAY_AUTH_TOKEN is set")
    if path.is_file() and path.stat().st_size > 0:
        if path.stat().st_mode & 0o077:
            return Check("Ray token", Status.WARN, f"{path} is readable by other users", f"chmod 600 {path}")
        return Check("Ray token", Status.OK, f"{path}")
    if creates_token:
        return Check("Ray token", Status.OK, f"none yet; created at {path} when Ray starts")
    return Check("Ray token", Status.WARN, f"no token at {path}: Ray would start without authentication",
                 "make demo or offload-serve serve creates it; or `ray get-auth-token --generate`")


def _tiny_zoo(family: str) -> Check:
    from zoo.cache import STAMP_NAME
    from zoo.paths import zoo_root

    folder = zoo_root() / f"tiny-{family}"
    if (folder / STAMP_NAME).is_file():
        return Check("model", Status.OK, f"the tiny zoo's {family} model, built at {folder}")
    return Check("model", Status.OK, f"the tiny zoo's {family} model: built on first use at {folder} "
                 "(seconds; nothing downloads)")


def check_model(model_path: str | None, tiny_family: str) -> Check:
    """The folder exists, is a diffusers folder, a family adapter serves it, and each loaded component has
    its safetensors weights (a named folder costs the registry's import of torch, about 2 s; the tiny
    zoo costs nothing)."""
    if model_path is None:
        return _tiny_zoo(tiny_family)
    folder = Path(model_path).expanduser()
    fix = "set args.model_path to a local diffusers folder (nothing downloads)"
    if not folder.is_dir():
        return Check("model", Status.FAIL, f"no folder {folder}", fix)
    if not (folder / "model_index.json").is_file():
        return Check("model", Status.FAIL, f"{folder} has no model_index.json: not a diffusers folder", fix)
    from deployments.models.registry import check_weights, read_family_traits

    try:
        facts = read_family_traits(folder)
        check_weights(facts)
    except ValueError as exc:  # UnsupportedModelFolder (no adapter, a variant it refuses, weights it cannot load)
        return Check("model", Status.FAIL, str(exc), "serve a folder of a supported family (docs/models.md)")
    return Check("model", Status.OK, f"{folder}: family {facts.family.value}")
