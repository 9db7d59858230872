"""Render the KubeRay RayService manifests in k8s/ from one fleet table and one table per variant.

    python k8s/render.py          # rewrite k8s/rayservice*.yaml
    python k8s/render.py --check  # exit 1 if a committed manifest differs from what this renders

Every manifest declares the whole GPU fleet (one worker group per GPU type, from zero unless a
variant sizes a group itself), so the same cluster can host any variant; a variant only chooses the
model, where each stage runs (one GPU type, or several for a stage that spans them) and its groups'
bounds. Numbers that matter (pod memory, object store, Ray resources) come from the tables in
k8s/manifest_tables.py, and tests/k8s/test_manifests.py checks them against the host budgets of the
real models. Run in the user's shell (and by the tests).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))  # k8s/pod_probes.py beside this file
import pod_probes  # noqa: E402  (the pods' startup, liveness and readiness probes)
from manifest_tables import (  # noqa: E402  (the fleet and variant tables, beside this file)
    FLEET,
    GPU_TYPE_LABEL,
    SHARED_LAYER_GIB,
    TP_VARIANTS,
    VARIANTS,
    GpuGroup,
    ServiceVariant,
    StagePlacement,
)

from deployments.capacity.work_autoscaling import POLICY_PATH  # noqa: E402  (the Denoiser's policy)
from deployments.replica.priority import RAY_NICENESS_ENV  # noqa: E402  (the replicas' niceness)

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
            # Ray starts its workers at niceness 15; the ray_actor_options below replace the app's
            # (which ask for args.replica_niceness, 0), runtime_env included, so it is said here too.
            "runtime_env": {"env_vars": {RAY_NICENESS_ENV: "0"}},
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
        "# Generated by k8s/render.py (edit the tables in k8s/manifest_tables.py, then `python k8s/render.py`).\n"
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
