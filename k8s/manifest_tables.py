"""The tables k8s/render.py renders the KubeRay manifests from: the GPU fleet (one worker group per
type) and the service variants (a real model and where each stage runs). Edit here, then run
``python k8s/render.py``; tests/k8s checks the figures against the real models.
"""
from __future__ import annotations

from dataclasses import dataclass

from offload_core.planner.gpus import gpu_model  # (the one GPU table)

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
