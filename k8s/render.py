"""Render the KubeRay RayService manifests in k8s/ from one fleet table and one table per variant.

    python k8s/render.py          # rewrite k8s/rayservice*.yaml
    python k8s/render.py --check  # exit 1 if a committed manifest differs from what this renders

Every manifest declares the whole GPU fleet (one worker group per GPU type, each scaling from
zero), so the same cluster can host any variant; a variant only chooses the model and where each
stage runs. Numbers that matter (pod memory, object store, Ray resources) come from the tables
below, and tests/k8s/test_manifests.py checks them against the host budgets of the real models.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))  # k8s/pod_probes.py beside this file
import pod_probes  # noqa: E402  (the pods' startup, liveness and readiness probes)

from deployments.capacity.work_autoscaling import POLICY_PATH  # noqa: E402  (the Denoiser's policy)
from offload_core.planner.gpus import gpu_model  # noqa: E402  (the one GPU table)

K8S_DIR = Path(__file__).resolve().parent
RAY_VERSION = "2.60.0"
# Built from this repository's Dockerfile (on top of rayproject/ray:2.60.0-py311-gpu).
IMAGE = "ghcr.io/offload-serve/offload-serve:0.1.0-ray2.60.0-py311-gpu"
# Ray's token authentication: every Ray port (GCS, raylet, dashboard, agents) wants this token.
# The Secret is created by whoever deploys (README in k8s/), never rendered into a manifest.
RAY_TOKEN_SECRET = "offload-serve-ray-token"
GI = 2**30
APP_NAME = "offload-serve"
# Requests sharing one Denoiser forward (the app's batching.max_batch): also the Denoiser's
# max_ongoing_requests, as build_app sets it, so Serve hands a replica exactly what one batch holds.
DENOISER_MAX_BATCH = 4
# The Denoiser scales on predicted work-seconds per replica (AppArgs.denoiser_scales_on: work), and a
# config file's autoscaling_config replaces build_app's, so the policy is named here. 60 s of queued
# work per replica: one 50-step 81-frame Wan2.1-14B video on an H100 is ~90 s (the app's graceful
# shutdown figure), so a replica holding more than two thirds of one asks for another.
DENOISER_TARGET_WORK_S = 60.0
ACCELERATOR_PREFIX = "accelerator_type:"  # Ray's resource name for accelerator_type placement
GPU_TYPE_LABEL = "offload-serve/gpu-type"  # each worker group's Ray node label: its accelerator_type


@dataclass(frozen=True)
class GpuGroup:
    """One KubeRay worker group: nodes with one GPU of one type."""

    name: str
    gpu_product: str  # node label nvidia.com/gpu.product, as GPU feature discovery writes it
    accelerator_type: str  # Ray accelerator_type; fleet profile's accelerator_type in configs/fleet
    cpus: int
    memory_gi: int  # pod memory request == limit: the cgroup the node ledger budgets against
    object_store_gi: int  # Ray object store, taken out of the host budget (it lives in /dev/shm)
    max_replicas: int
    gpus: int = 1  # GPUs per pod: 2 for a group whose pods host a tensor-parallel stage replica

    @property
    def gpu_memory_gb(self) -> int:
        """From the one GPU table (configs/models/real_model_configs.json), never restated here."""
        return gpu_model(self.accelerator_type).memory_gb


# Pod sizes are a 1-GPU slice of a typical cloud shape, less ~10 % for kubelet and daemonsets:
# RTX 3060 desktop 64 GB, g2-standard-16 (L4) 64 GB, g5.4xlarge (A10G) 64 GiB, g6e.4xlarge (L40S)
# 128 GiB, a2-ultragpu-1g (A100 80GB) 170 GB, a3-highgpu-1g (H100) 234 GB, p5en/8 (H200) 256 GiB.
# Object store: stage outputs are small (a 512-token bf16 umT5 embedding is 4 MiB, 81-frame
# 480x832 latents 8 MiB) but a decoded 81-frame fp32 video is 388 MB; 4 GiB holds ~10 of them.
FLEET: tuple[GpuGroup, ...] = (
    GpuGroup("rtx3060-12gb", "NVIDIA-GeForce-RTX-3060", "RTX3060", 8, 56, 4, 4),
    GpuGroup("l4-24gb", "NVIDIA-L4", "L4", 14, 56, 4, 8),
    GpuGroup("a10g-24gb", "NVIDIA-A10G", "A10G", 14, 56, 4, 8),
    GpuGroup("l40s-48gb", "NVIDIA-L40S", "L40S", 14, 112, 8, 4),
    GpuGroup("a100-80gb", "NVIDIA-A100-SXM4-80GB", "A100-80G", 11, 150, 8, 4),
    GpuGroup("h100-80gb", "NVIDIA-H100-80GB-HBM3", "H100", 24, 200, 8, 4),
    GpuGroup("h200-141gb", "NVIDIA-H200", "H200", 24, 230, 8, 2),
)


@dataclass(frozen=True)
class StagePlacement:
    """Where one stage deployment runs and how it scales."""

    deployment: str  # TextEncoder | Denoiser | VaeDecoder (deployments/replica/stages.py)
    args_key: str  # encoder | denoiser | decoder (deployments.app.AppArgs)
    # One type: the stage is pinned to it (accelerator_type). Several: the stage spans them; its
    # replicas ask for a GPU and a label selector over the groups' offload-serve/gpu-type label, so
    # each replica lands on whichever of those groups has room and plans for the GPU it got.
    accelerator_type: str | tuple[str, ...]
    num_gpus: float  # fraction of one GPU; stages sharing a GPU lease its memory from the node ledger
    # deployments.wire.spec.OffloadMode value; None: each replica takes its fleet profile's mode for
    # the GPU it landed on (a spanning stage: SPEED on an H100, BALANCED on an L4).
    offload_mode: str | None
    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float
    tp_size: int = 1  # ranks per replica: one whole GPU each, all in one pod (deployments/replica/tensor_parallel/group.py)

    @property
    def gpu_types(self) -> tuple[str, ...]:
        """The GPU types a replica may land on (one for a pinned stage)."""
        return (self.accelerator_type,) if isinstance(self.accelerator_type, str) else self.accelerator_type

    @property
    def spans(self) -> bool:
        return len(self.gpu_types) > 1

    def placement_options(self) -> dict:
        """The ray_actor_options that place it: a pinned type, or a GPU on any group of its types."""
        if not self.spans:
            return {"accelerator_type": self.accelerator_type}
        return {"label_selector": {GPU_TYPE_LABEL: f"in({','.join(self.gpu_types)})"}}


@dataclass(frozen=True)
class ServiceVariant:
    """One RayService: a real model and the GPU type of each stage."""

    file_name: str
    service_name: str
    real_model: str  # key of configs/models/real_model_configs.json (checked by the tests)
    model_path: str  # diffusers folder on the read-only models volume
    dtype: str
    stages: tuple[StagePlacement, ...]
    about: str
    extra_groups: tuple[GpuGroup, ...] = ()  # beyond the fleet: multi-GPU pods for tensor-parallel stages
    # (accelerator_type, minReplicas, maxReplicas) of the groups this variant sizes itself; every
    # other group keeps the fleet's: from zero up to its max_replicas.
    group_replicas: tuple[tuple[str, int, int], ...] = ()

    def replicas_of(self, group: GpuGroup) -> tuple[int, int]:
        """minReplicas and maxReplicas of ``group`` in this variant."""
        for accelerator_type, low, high in self.group_replicas:
            if accelerator_type == group.accelerator_type and group.gpus == 1:
                return low, high
        return 0, group.max_replicas


VARIANTS: tuple[ServiceVariant, ...] = (
    ServiceVariant(
        "rayservice.yaml", "offload-serve-wan14b", "wan2.1-t2v-14b", "/models/Wan2.1-T2V-14B-Diffusers", "bfloat16",
        (
            # umT5-XXL in bf16 is 11.4 GB: resident on half an L4, next to the decoder.
            StagePlacement("TextEncoder", "encoder", "L4", 0.5, "auto", 1, 4, 4),
            # The 28.6 GB DiT runs 50 steps per request: resident on an H100, it never streams.
            StagePlacement("Denoiser", "denoiser", "H100", 1.0, "speed", 1, 4, 1),
            StagePlacement("VaeDecoder", "decoder", "L4", 0.5, "auto", 1, 4, 2),
        ),
        "Wan2.1-T2V-14B on a mixed fleet: encoder and decoder share L4s, the denoiser gets an H100.",
    ),
    ServiceVariant(
        "rayservice-consumer-12gb.yaml", "offload-serve-wan1-3b-12gb", "wan2.1-t2v-1.3b",
        "/models/Wan2.1-T2V-1.3B-Diffusers", "bfloat16",
        (
            # All three stages share one 12 GB card; the node ledger serializes their working sets.
            StagePlacement("TextEncoder", "encoder", "RTX3060", 0.34, "memory", 1, 4, 2),
            StagePlacement("Denoiser", "denoiser", "RTX3060", 0.33, "balanced", 1, 4, 1),
            StagePlacement("VaeDecoder", "decoder", "RTX3060", 0.33, "auto", 1, 4, 2),
        ),
        "Wan2.1-T2V-1.3B on 12 GB consumer cards: the three stages share one GPU per node.",
    ),
    ServiceVariant(
        "rayservice-flux.yaml", "offload-serve-flux-dev", "flux.1-dev", "/models/FLUX.1-dev", "bfloat16",
        (
            # CLIP-L + T5-XXL in bf16 are 9.8 GB; the VAE decode of a 1024x1024 image is ~2 GB.
            StagePlacement("TextEncoder", "encoder", "A10G", 0.5, "auto", 1, 4, 4),
            # The 23.8 GB DiT streams on a 24 GB card but sits resident with room on a 48 GB L40S.
            StagePlacement("Denoiser", "denoiser", "L40S", 1.0, "speed", 1, 4, 1),
            StagePlacement("VaeDecoder", "decoder", "A10G", 0.5, "auto", 1, 4, 2),
        ),
        "FLUX.1-dev: encoders and decoder share A10Gs, the denoiser runs on an L40S.",
    ),
    ServiceVariant(
        "rayservice-mixed.yaml", "offload-serve-wan14b-mixed", "wan2.1-t2v-14b", "/models/Wan2.1-T2V-14B-Diffusers",
        "bfloat16",
        (
            StagePlacement("TextEncoder", "encoder", "L4", 0.5, "auto", 1, 4, 4),
            # One Denoiser over both groups: an H100 replica holds the 28.6 GB DiT resident (its
            # profile's SPEED), an L4 replica streams it (BALANCED, a third resident); the router and
            # the autoscaling policy weigh each replica's queue by its measured seconds per step.
            StagePlacement("Denoiser", "denoiser", ("L4", "H100"), 1.0, None, 1, 6, 1),
            StagePlacement("VaeDecoder", "decoder", "L4", 0.5, "auto", 1, 4, 2),
        ),
        "Wan2.1-T2V-14B on a mixed fleet: one Denoiser deployment over L4 and H100 groups; encoder and "
        "decoder share L4s.",
        # The encoder and decoder keep one L4 up anyway (min_replicas 1 each, half an L4 apiece); H100s
        # only while the Denoiser's load asks for them.
        group_replicas=(("L4", 1, 6), ("H100", 0, 2)),
    ),
)


# Tensor parallelism: umT5-XXL's encoder over the two L4s of one pod (g2-standard-24: 2 x L4, 96 GB;
# a 2-GPU slice less ~10 %), each rank keeping its half (5.3 GiB bf16) of it on its own GPU.
L4X2 = GpuGroup("l4x2-48gb", "NVIDIA-L4", "L4", 22, 84, 4, 4, gpus=2)
TP_VARIANTS: tuple[ServiceVariant, ...] = (
    ServiceVariant(
        "tp/rayservice-wan14b-tp2.yaml", "offload-serve-wan14b-tp2", "wan2.1-t2v-14b",
        "/models/Wan2.1-T2V-14B-Diffusers", "bfloat16",
        (
            StagePlacement("TextEncoder", "encoder", "L4", 1.0, "speed", 1, 2, 4, tp_size=2),
            StagePlacement("Denoiser", "denoiser", "H100", 1.0, "speed", 1, 4, 1),
            StagePlacement("VaeDecoder", "decoder", "L4", 0.5, "auto", 1, 4, 2),
        ),
        "Wan2.1-T2V-14B with its text encoder tensor-parallel over the 2 L4s of one pod (tp_size 2).",
        extra_groups=(L4X2,),
    ),
)


# GiB of streamable layer bytes per (real model, stage) in bf16, measured on torch's meta device
# with offload_core's layout (tests/k8s checks each figure): what one node weight store of the
# stage holds in /dev/shm however many of its replicas the node runs. The VAE streams up_blocks
# (0.11 GiB); Flux's AutoencoderKL declares no layer groups.
SHARED_LAYER_GIB = {
    ("wan2.1-t2v-14b", "TextEncoder"): 8.63, ("wan2.1-t2v-14b", "Denoiser"): 26.18,
    ("wan2.1-t2v-14b", "VaeDecoder"): 0.11,
    ("wan2.1-t2v-1.3b", "TextEncoder"): 8.63, ("wan2.1-t2v-1.3b", "Denoiser"): 2.60,
    ("wan2.1-t2v-1.3b", "VaeDecoder"): 0.11,
    ("flux.1-dev", "TextEncoder"): 8.78, ("flux.1-dev", "Denoiser"): 22.05, ("flux.1-dev", "VaeDecoder"): 0.0,
}


def shared_store_gi(variant: ServiceVariant, group: GpuGroup) -> int:
    """/dev/shm the node weight stores of the stages placed on ``group`` need (speed mode streams nothing)."""
    # A stage in its fleet profile's mode (None) may stream: counted (a sizeLimit caps, reserves nothing).
    gib = sum(SHARED_LAYER_GIB[(variant.real_model, s.deployment)] for s in variant.stages
              if group.accelerator_type in s.gpu_types and s.offload_mode != "speed")
    return math.ceil(gib)


def _ray_resources(group: GpuGroup) -> str:
    # KubeRay passes rayStartParams to `ray start` through a shell: the JSON is quoted once more.
    # Declaring accelerator_type:<T> lets the autoscaler see a zero-node group satisfy
    # accelerator_type=<T> demand; Ray's own detection names consumer cards differently
    # ("GeForce-RTX-3060"), so the fleet's name is declared explicitly.
    return json.dumps(json.dumps({f"{ACCELERATOR_PREFIX}{group.accelerator_type}": 1}))


def _container(name: str, cpus: int, memory_gi: int, gpus: int, object_store_gi: int) -> dict:
    limits = {"cpu": str(cpus), "memory": f"{memory_gi}Gi"}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    return {
        "name": name,
        "image": IMAGE,
        "env": [
            {"name": "HF_HUB_OFFLINE", "value": "1"},  # models come from the volume; nothing downloads
            {"name": "TRANSFORMERS_OFFLINE", "value": "1"},
            {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"},
        ],
        # requests == limits: the Guaranteed QoS class, and one cgroup limit the node ledger reads.
        "resources": {"limits": dict(limits), "requests": dict(limits)},
        "volumeMounts": [
            {"name": "models", "mountPath": "/models", "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }


def _volumes(object_store_gi: int, store_gi: int = 0) -> list[dict]:
    return [
        {"name": "models", "persistentVolumeClaim": {"claimName": "offload-serve-models", "readOnly": True}},
        # The object store and the node weight stores (one shared copy of each streamed stage's
        # layers) live in /dev/shm, which counts against the pod's memory limit; +1 Gi of slack.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{object_store_gi + store_gi + 1}Gi"}},
    ]


def head_group() -> dict:
    cpus, memory_gi, store_gi = 4, 16, 2
    return {
        # The head runs the Serve controller, the HTTP proxy and the Ingress; no GPU, so no stage
        # replica can land here (every stage asks for num_gpus > 0).
        "rayStartParams": {
            "num-cpus": str(cpus),
            "num-gpus": "0",
            "object-store-memory": str(store_gi * GI),
            "dashboard-host": "0.0.0.0",
            "dashboard-agent-listen-port": str(pod_probes.AGENT_PORT),  # where the probes ask
        },
        "template": {
            "metadata": {"labels": {"app.kubernetes.io/name": APP_NAME, "app.kubernetes.io/component": "head"}},
            "spec": {
                "containers": [_container("ray-head", cpus, memory_gi, 0, store_gi)
                               | {"ports": [{"containerPort": 6379, "name": "gcs"},
                                            {"containerPort": 8265, "name": "dashboard"},
                                            {"containerPort": pod_probes.SERVE_PORT, "name": "serve"}]}
                               | pod_probes.head_probes()],
                "volumes": _volumes(store_gi),
            },
        },
    }


def worker_group(group: GpuGroup, variant: ServiceVariant) -> dict:
    low, high = variant.replicas_of(group)
    return {
        "groupName": group.name,
        "replicas": low,
        "minReplicas": low,  # 0: scale from zero; the autoscaler reads num-gpus and resources below
        "maxReplicas": high,
        "rayStartParams": {
            "num-cpus": str(group.cpus),
            "num-gpus": str(group.gpus),
            "object-store-memory": str(group.object_store_gi * GI),
            "resources": _ray_resources(group),
            "dashboard-agent-listen-port": str(pod_probes.AGENT_PORT),  # where the probes ask
        },
        # Ray node labels (for label_selector and the v2 autoscaler). KubeRay rejects `labels` in
        # rayStartParams ("use the top-level Labels field"), and the autoscaler ignores it there.
        "labels": {GPU_TYPE_LABEL: group.accelerator_type,
                   "offload-serve/gpu-memory-gb": str(group.gpu_memory_gb)},
        "template": {
            "metadata": {"labels": {"app.kubernetes.io/name": APP_NAME, "app.kubernetes.io/component": "worker",
                                    GPU_TYPE_LABEL: group.accelerator_type}},
            "spec": {
                "nodeSelector": {"nvidia.com/gpu.product": group.gpu_product},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                # The serve port: the node's Serve proxy, which the readiness probe asks.
                "containers": [_container("ray-worker", group.cpus, group.memory_gi, group.gpus, group.object_store_gi)
                               | {"ports": [{"containerPort": pod_probes.SERVE_PORT, "name": "serve"}]}
                               | pod_probes.worker_probes()],
                "volumes": _volumes(group.object_store_gi, shared_store_gi(variant, group)),
            },
        },
    }


def _tp_args(stage: StagePlacement) -> dict:
    return {"tp_size": stage.tp_size, "tp_device": "gpu"} if stage.tp_size > 1 else {}


def serve_config(variant: ServiceVariant) -> dict:
    args = {
        "app_name": APP_NAME,
        "model_path": variant.model_path,
        "model_id": variant.real_model,
        "dtype": variant.dtype,
        **{s.args_key: {"offload_mode": s.offload_mode, **_tp_args(s)} for s in variant.stages},
        "batching": {"max_batch": DENOISER_MAX_BATCH},
        "device_timeout_s": 30.0,
        "retry_after_s": 2,
        # enableInTreeAutoscaling adds GPU nodes for waiting replicas: build_app need not warn that the
        # GPUs present (none, while a worker group is at zero) cannot hold the configured maximum.
        "cluster_autoscaler": True,
    }
    deployments = [{
        "name": "Ingress",
        "max_ongoing_requests": 64,
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 32},
        "ray_actor_options": {"num_cpus": 1},
    }]
    for s in variant.stages:
        deployments.append({
            "name": s.deployment,
            # The Denoiser batches at step boundaries: it takes as many requests as one batch holds
            # (a smaller figure here would cap every batch below max_batch). The other stages run one
            # call at a time (the pipeline is not reentrant); a few queue.
            "max_ongoing_requests": (DENOISER_MAX_BATCH if s.deployment == "Denoiser"
                                     else max(2, int(2 * s.target_ongoing_requests))),
            "autoscaling_config": {
                "min_replicas": s.min_replicas,
                "max_replicas": s.max_replicas,
                "target_ongoing_requests": s.target_ongoing_requests,
                "upscale_delay_s": 10,
                "downscale_delay_s": 300,  # a GPU node takes minutes to come back: keep it a while
                **({"policy": {"policy_function": POLICY_PATH,
                               "policy_kwargs": {"target_work_s": DENOISER_TARGET_WORK_S}}}
                   if s.deployment == "Denoiser" else {}),
            },
            # A tensor-parallel stage asks for no GPU itself: build_app gives its replica one bundle
            # with a whole GPU per rank (strict pack, so one pod of the multi-GPU group).
            "ray_actor_options": {"num_cpus": 1, **({"num_gpus": s.num_gpus} if s.tp_size == 1 else {}),
                                  **s.placement_options()},
        })
    return {
        # A proxy on every node with a replica: KubeRay's serve Service selects every worker pod whose
        # readiness passes, and a worker's readiness asks its own proxy (k8s/pod_probes.py). With
        # HeadOnly no worker could ever be ready (KubeRay's default probe asks the same proxy).
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": pod_probes.SERVE_PORT},
        "applications": [{
            "name": APP_NAME,
            "route_prefix": "/",
            "import_path": "deployments.app:build_app",
            "args": args,
            "deployments": deployments,
        }],
    }


def rayservice(variant: ServiceVariant) -> dict:
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {
            "name": variant.service_name,
            "labels": {"app.kubernetes.io/name": APP_NAME},
            "annotations": {"offload-serve/real-model": variant.real_model},
        },
        "spec": {
            "serveConfigV2": _Literal(yaml.safe_dump(serve_config(variant), sort_keys=False)),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "authOptions": {"mode": "token", "secretName": RAY_TOKEN_SECRET},
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {
                    # v2 reads the groups' labels and scales a group from zero for resource or label demand.
                "version": "v2",
                "upscalingMode": "Default",
                    "idleTimeoutSeconds": 600,  # GPU nodes are slow to come back; idle 10 min first
                    "resources": {"limits": {"cpu": "500m", "memory": "512Mi"},
                                  "requests": {"cpu": "500m", "memory": "512Mi"}},
                },
                "headGroupSpec": head_group(),
                "workerGroupSpecs": [worker_group(g, variant) for g in FLEET + variant.extra_groups],
            },
        },
    }


class _Literal(str):
    """A string dumped as a YAML block literal (serveConfigV2 reads as YAML inside YAML)."""


def _literal(dumper: yaml.SafeDumper, value: _Literal) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", str(value), style="|")


yaml.SafeDumper.add_representer(_Literal, _literal)


def render(variant: ServiceVariant) -> str:
    header = (
        f"# {variant.about}\n"
        "# Generated by k8s/render.py (edit the tables there, then `python k8s/render.py`).\n"
        f"# Worker groups ({'GPUs' if variant.extra_groups else 'one GPU'} each; pod memory = host budget cgroup):\n"
        + "".join(f"#   {g.name:<13} {g.gpu_memory_gb:>3} GB GPU{f' x{g.gpus}' if g.gpus > 1 else ''}  "
                  f"{g.memory_gi:>3}Gi pod  {g.object_store_gi}Gi object store  accelerator_type={g.accelerator_type}\n"
                  for g in FLEET + variant.extra_groups)
    )
    return header + yaml.safe_dump(rayservice(variant), sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if a committed manifest is stale")
    args = parser.parse_args(argv)
    stale = []
    for variant in VARIANTS + TP_VARIANTS:
        path = K8S_DIR / variant.file_name
        text = render(variant)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale manifests (run python k8s/render.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
