"""The typed application builder: ``serve run deployments.app:build_app`` or ``configs/local.yaml``.

All ``.bind()`` wiring is here. Per-deployment Serve options (ray_actor_options, autoscaling,
max_ongoing_requests, max_queued_requests) come from the Serve config file by deployment name and
override the defaults set below; the offload mode per stage, the model and the limits come from
``args``. Model folders come from here only, never from a request.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from typing import Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray.serve import Application

from deployments.capacity import unplaced, work_autoscaling
from deployments.capacity.request_limits import Limits
from deployments.capacity.work_autoscaling import DEFAULT_TARGET_WORK_S, ScalingSignal
from deployments.ingress.deployment import Ingress, IngressConfig
from deployments.jobs.queue import JobsArgs
from deployments.models.families import FamilyTraits, read_family_traits, uses_per_request
from deployments.models.lora_rows import ServedLora
from deployments.models.registry import check_weights
from deployments.models.tensor_parallel import check_tp
from deployments.models.vae_tiling import TILE_MULTIPLE, VaeTiling
from deployments.models.vae_tiling import resolve as resolve_tiling
from deployments.replica.batching import BatchingConfig
from deployments.replica.priority import stage_actor_options
from deployments.replica.stages import Denoiser, TextEncoder, VaeDecoder
from deployments.replica.warmup import WarmupShape
from deployments.replica.worker import DTYPES, StageConfig
from deployments.routing.config import RoutingMode, router_options
from deployments.wire.spec import Family, PipelineStage
from offload_core.compile import CompileConfig, CompileMode, parse_bucket
from offload_core.host.budget_cap import HostBudgetSpec, parse_host_budget
from offload_core.planner.search import PerformanceMode
from offload_core.quant import WeightFormat
from offload_core.tables import HostTablesConfig

logger = logging.getLogger(__name__)


class StageArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # offload_core's performance mode: auto (fastest plan that fits), speed, memory, balanced; null:
    # the fleet profile's mode for the GPU the replica got (configs/fleet/fleet.yaml). The profile's
    # limits (prefetch depth, resident fraction, pin cap) apply either way.
    offload_mode: PerformanceMode | None = None
    # Host RAM each replica of the stage may hold for its weights: a size ("16GiB", "512MB") or a
    # fraction of the node's spendable RAM (0.25). None: the node ledger's per-replica cap only.
    # The replica plans within min(this, what the node ledger grants).
    host_memory_budget: str | float | int | None = None
    # Host the stage's streamed layers from the node weight store: one read-only shared-memory copy
    # per node, whatever the number of replicas (false: each replica keeps its own copy).
    share_host_weights: bool = True
    # How the stage's streamed layers are hosted and copied: native (as loaded) or fp8 (Linear/Conv
    # weights as e4m3 with per-channel scales, widened on the device: half the host bytes and the
    # bytes per copy of a bf16 model; lossy, so opt-in; see offload_core/quant.py).
    weights: WeightFormat = WeightFormat.NATIVE
    # The Denoiser only: the step cache's threshold for requests that set none (their
    # cache_threshold); 0 is off. See deployments/models/step_cache.py.
    cache_threshold: float = Field(0.0, ge=0.0, le=1.0)
    # Ranks per replica (tensor parallelism): the replica holds tp_size bundles of its node, one GPU
    # each (strict pack), and runs one rank worker per bundle. 1: one process, today's path. Only
    # stages whose components have a plan (offload_core.tensor_parallel.plans) accept more.
    tp_size: int = Field(1, ge=1)
    # Whether a rank's bundle holds a GPU: "auto" asks the cluster at build time (no GPU anywhere:
    # CPU bundles, gloo); "gpu" for clusters whose GPU nodes an autoscaler adds later (KubeRay).
    tp_device: str = Field("auto", pattern="^(auto|gpu|cpu)$")
    # Token tables at least this large are considered for the host (offload_core.tables); None: 256 MiB.
    # A tensor-parallel (sharded) table never is: the report says so.
    host_tables_min_bytes: int | None = Field(None, ge=0)
    # torch.compile of the stage's repeated blocks (docs/compile.md): none (eager) or blocks (each block
    # class compiled once, streamed and resident layers alike, before the replica reports ready).
    compile: CompileMode = CompileMode.NONE
    # With compile: blocks, the request shapes compiled at start, one bucket per entry: shapes "WxH" or
    # "WxHxF" joined by "," share one graph. Empty: the default request (and the default image for a
    # family serving both), at batch 1 and max_batch.
    compile_buckets: list[str] = []
    # Inductor's on-disk cache folder (a restarted replica loads its graphs instead of compiling them);
    # null: torch's default (a folder under /tmp).
    compile_cache_dir: str | None = None
    # The decoder only: decode outputs larger than the VAE's tile tile by tile (docs/memory.md, "Tiled VAE
    # decoding"): on, off, or auto (the family's published usage: HunyuanVideo 1.5 tiles, whose untiled 480p
    # video decode holds 82 GiB; the others do not). The pixels differ slightly from an untiled decode.
    vae_tiling: VaeTiling = VaeTiling.AUTO
    # With vae_tiling, the tile's side in output pixels (a multiple of 64); null: the VAE's own (256 px for
    # Wan, Qwen-Image and HunyuanVideo 1.5, the config's sample_size for FLUX.1, SD3.5 and Z-Image).
    vae_tile_px: int | None = Field(None, ge=TILE_MULTIPLE, multiple_of=TILE_MULTIPLE)

    @field_validator("compile_buckets")
    @classmethod
    def _parse_buckets(cls, value):
        for text in value:
            parse_bucket(text)  # a typo fails build_app, not a replica's start
        return value

    @field_validator("host_memory_budget")
    @classmethod
    def _parse_budget(cls, value):
        if value is not None:
            parse_host_budget(value)  # a typo fails build_app, not a replica's start
        return value

    def tables(self) -> HostTablesConfig:
        return HostTablesConfig() if self.host_tables_min_bytes is None else HostTablesConfig(self.host_tables_min_bytes)

    def host_budget(self) -> HostBudgetSpec | None:
        return None if self.host_memory_budget is None else parse_host_budget(self.host_memory_budget)

    def compile_config(self) -> CompileConfig | None:
        if self.compile is CompileMode.NONE:
            return None
        return CompileConfig(self.compile, buckets=tuple(parse_bucket(t) for t in self.compile_buckets),
                             cache_dir=self.compile_cache_dir)


class BatchingArgs(BaseModel):
    """The Denoiser's step-level batching (``deployments.replica.batching``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Requests sharing one forward, and so one stream of the weights. Also the Denoiser's
    # max_ongoing_requests: Serve routes the rest to other replicas or queues them.
    max_batch: int = Field(4, ge=1)
    # A request that finds no room in a compatible batch for this long fails (503).
    max_wait_s: float = Field(600.0, gt=0)
    # An idle Denoiser waits this long for companions before its first forward (at most a tenth of
    # its last forward), so requests sent together share every step.
    gather_s: float = Field(0.01, ge=0)

    def config(self) -> BatchingConfig:
        return BatchingConfig(self.max_batch, self.max_wait_s, self.gather_s)


class LoraArgs(BaseModel):
    """One LoRA adapter a request may name (``lora`` in the body); the Denoiser loads it at start."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # What requests name it by (``"lora": "<name>"``); GET /v1/models lists it.
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    # A local diffusers/PEFT LoRA .safetensors file, or a folder holding one (only safetensors load).
    path: str
    # The adapter's strength for requests that set no lora_scale.
    scale: float = Field(1.0, ge=-4.0, le=4.0)
    # The model families it was trained for (wan, flux, ...): build_app refuses it for another family.
    families: tuple[Family, ...] = Field(min_length=1)

    def served(self) -> ServedLora:
        return ServedLora(self.name, str(pathlib.Path(self.path).expanduser().resolve()), self.scale)


class AppArgs(BaseModel):
    """Everything ``build_app`` needs; ``serve run`` passes the config file's ``args`` here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Serve application name: names the residency board; must match the config's application name.
    app_name: str = "offload-serve"
    # A local diffusers folder of a family in docs/models.md. None: the tiny zoo of `tiny_family`.
    model_path: str | None = None
    # Which tiny zoo model serves when model_path is None (the demo and the tests).
    tiny_family: str = Field("wan", pattern="^(wan|flux)$")
    # The id clients pass as "model" (GET /v1/models); None: the folder's name.
    model_id: str | None = None
    # The dtype every stage loads the weights in (bfloat16 for the real models on a GPU).
    dtype: str = Field("float32", pattern="^(" + "|".join(DTYPES) + ")$")
    # The text encoder stage (TextEncoder deployment): its offload mode, host budget, weights.
    encoder: StageArgs = StageArgs()
    # The denoising stage (Denoiser deployment), which runs every step.
    denoiser: StageArgs = StageArgs()
    # The VAE decoder stage (VaeDecoder deployment; it also encodes a reference image).
    decoder: StageArgs = StageArgs()
    # The Denoiser's step-level batching.
    batching: BatchingArgs = BatchingArgs()
    # What one request may ask for; anything beyond is a 400 naming the field.
    limits: Limits = Limits()
    # The bearer token is read from this environment variable (so it never sits in a config file);
    # None or an unset variable: no authentication.
    api_token_env: str | None = None
    # How long a replica waits for its device lease (GPU memory neighbours hold) before the call fails
    # with 503 + Retry-After.
    device_timeout_s: float = Field(30.0, gt=0)
    # The least Retry-After (seconds) a 503 from the service carries.
    retry_after_s: int = Field(2, ge=1)
    # The Videos API's jobs: where the SQLite file and the results live, expiry, leases.
    video_jobs: JobsArgs = JobsArgs()
    # Defaults for every replica; a Serve config file overrides them per deployment by name.
    # 0.25 CPU each so the whole app (4 deployments) fits on a 2-CPU machine.
    replica_num_cpus: float = Field(0.25, ge=0)
    # The niceness the stage replicas (and their tensor-parallel ranks) run at. Ray starts every
    # worker at 15 (RAY_worker_niceness; measured in an actor of Ray 2.60), below the raylet and any
    # nice-0 process on the node, and a launch-bound step (one latent frame on the H200: 35 ms of
    # kernels launched from one thread) waits whenever those want its core. 0: the default of every
    # other process; a lower one needs CAP_SYS_NICE. None keeps Ray's.
    replica_niceness: int | None = Field(0, ge=0, le=19)
    # A stage replica runs one call at a time (its pipeline is not reentrant); more queue, and
    # beyond the queue Serve refuses (BackPressureError -> 503 with Retry-After).
    stage_max_queued_requests: int = Field(16, ge=1)
    # The ingress only awaits stages, so it may hold many requests at once.
    ingress_max_ongoing_requests: int = Field(64, ge=1)
    # Browser origins allowed to call the API (CORS); empty: no CORS headers at all.
    cors_allow_origins: tuple[str, ...] = ()
    # A replica being replaced (config update, scale-down) stops taking requests and gets this long
    # to finish the ones it has; requests still running then fail with 503 (never silently). 120 s
    # covers a 50-step 81-frame Wan 14B call on an H100 (~90 s); the tiny zoo needs under 1 s.
    graceful_shutdown_timeout_s: float = Field(120.0, gt=0)
    # Extra replicas (percent of each deployment's count) started during a rolling update, so the
    # old ones serve until their replacements are ready: without it a 1-replica stage has none for
    # as long as the new one takes to load (30-55 s measured here under test load). 0 stops old
    # replicas first, for GPUs that cannot hold two copies of a stage's working set.
    update_surge_percent: int = Field(100, ge=0, le=100)
    # Whether the cluster adds nodes when replicas wait for resources (KubeRay's in-tree autoscaling:
    # the k8s manifests set true). false: the nodes present are all there will be, so build_app warns
    # when the configured maximum replicas x num_gpus can never be placed on their GPUs. null: detected
    # (Ray's autoscaler v2 in the GCS), else false.
    cluster_autoscaler: bool | None = None
    # How requests reach the Denoiser's replicas: "predicted" (each to the replica with the earliest
    # predicted finish, from every replica's queue and its measured seconds per step: a mixed fleet's
    # fast GPUs take more; deployments/routing) or "default" (Serve's power of two choices on queue length).
    routing: RoutingMode = RoutingMode.PREDICTED
    # How often Serve's controller asks each Denoiser replica for its routing stats; the router stops
    # sending work to a replica whose stats are two periods old (hung or gone).
    routing_stats_period_s: float = Field(1.0, gt=0)
    # What the Denoiser's autoscaling counts, when its Serve options autoscale: "work" (predicted
    # work-seconds per replica, each replica's queue at its own measured seconds per step, so a slow
    # GPU's queue weighs more: deployments/capacity/work_autoscaling.py) or "requests" (Serve's ongoing
    # requests). A Serve config file's autoscaling_config replaces build_app's whole: name the policy
    # there (configs/local.yaml and the k8s manifests do); build_app warns when one does not.
    denoiser_scales_on: ScalingSignal = ScalingSignal.WORK
    # The work policy's target: predicted seconds of queued work per Denoiser replica.
    denoiser_target_work_s: float = Field(DEFAULT_TARGET_WORK_S, gt=0)
    # LoRA adapters requests may choose by name (docs/models.md, "LoRA adapters"); applied unmerged per
    # request in the Denoiser, so requests with different adapters (or none) share a step batch.
    lora_adapters: tuple[LoraArgs, ...] = ()
    # Device memory the Denoiser's adapters may hold (A and B matrices of every adapter loaded; least
    # recently used ones are evicted beyond it and loaded again when named): a size ("1GiB", "256MB").
    lora_device_budget: str | int = "1GiB"

    @field_validator("lora_device_budget")
    @classmethod
    def _parse_lora_budget(cls, value):
        if parse_host_budget(value).nbytes is None:
            raise ValueError("lora_device_budget is a size (\"1GiB\"), not a fraction")
        return value

    def lora_budget_bytes(self) -> int:
        return int(parse_host_budget(self.lora_device_budget).nbytes)


def _mode(stage: StageArgs) -> str:
    return stage.offload_mode.value if stage.offload_mode is not None else "fleet profile's"


def resolve_model_folder(args: AppArgs) -> pathlib.Path:
    if args.model_path is not None:
        return pathlib.Path(args.model_path).expanduser().resolve()
    from zoo import tiny  # the embedded default; built on first use, nothing downloads

    return tiny.ensure_tiny_wan() if args.tiny_family == "wan" else tiny.ensure_tiny_flux()


def served_loras(args: AppArgs, facts: FamilyTraits) -> tuple[ServedLora, ...]:
    """The configured adapters, checked before any replica starts: unique names, the served family among
    each one's, a safetensors file or folder that exists (the Denoiser checks their modules and ranks)."""
    names = [lora.name for lora in args.lora_adapters]
    if len(set(names)) != len(names):
        raise ValueError(f"lora_adapters: names must be unique, got {names}")
    if args.lora_adapters and (facts.experts != ("transformer",) or args.denoiser.tp_size > 1):
        raise ValueError(f"lora_adapters: adapters apply to one unsharded transformer; this deployment has "
                         f"{facts.experts} at denoiser.tp_size {args.denoiser.tp_size}")
    for lora in args.lora_adapters:
        if facts.family not in lora.families:
            raise ValueError(f"lora_adapters: {lora.name!r} fits {[f.value for f in lora.families]}, not the served "
                             f"{facts.family.value} model")
        path = pathlib.Path(lora.served().path)
        found = (path.is_file() and path.suffix == ".safetensors") or (path.is_dir() and any(path.glob("*.safetensors")))
        if not found:
            raise ValueError(f"lora_adapters: {lora.name!r}: {path} is neither a .safetensors file nor a folder "
                             "holding one")
    return tuple(lora.served() for lora in args.lora_adapters)


def stage_configs(args: AppArgs, facts: FamilyTraits) -> dict[str, StageConfig]:
    """What each stage replica is built with, by stage."""
    options = {PipelineStage.ENCODE: args.encoder, PipelineStage.DENOISE: args.denoiser,
               PipelineStage.DECODE: args.decoder}
    configs = {}
    shape = WarmupShape.default_for(args.limits, facts)  # a default size the API would refuse fails the build
    if args.limits.default_steps < facts.min_steps:  # every request naming no steps would be refused
        raise ValueError(f"limits.default_steps: {args.limits.default_steps} is too few for this model, which needs "
                         f"at least {facts.min_steps} (its scheduler's shift_terminal={facts.shift_terminal})")
    loras = served_loras(args, facts)
    for stage, stage_args in options.items():
        if stage is not PipelineStage.DENOISE and stage_args.cache_threshold:
            raise ValueError(f"{stage.value}: cache_threshold is the denoiser's step cache; the {stage.value} "
                             "stage runs once per request and has no steps to skip")
        if stage is not PipelineStage.DECODE and (stage_args.vae_tiling is not VaeTiling.AUTO
                                                  or stage_args.vae_tile_px is not None):
            raise ValueError(f"{stage.value}: vae_tiling and vae_tile_px are the decoder's; the {stage.value} stage "
                             "runs no VAE")
        # Planned for the default request; a request with more steps streams the same plan longer.
        uses = uses_per_request(facts, stage, args.limits.default_steps, facts.default_guidance,
                                batched=stage is PipelineStage.DENOISE)
        batching = args.batching.config() if stage is PipelineStage.DENOISE else None
        check_tp(facts, stage, stage_args.tp_size)  # a stage without a plan fails the build, naming those with one
        configs[stage] = StageConfig(args.app_name, facts, stage, stage_args.offload_mode, tuple(uses.items()),
                                     args.dtype, args.device_timeout_s, stage_args.host_budget(), batching,
                                     share_host_weights=stage_args.share_host_weights, warmup_shape=shape,
                                     weights=stage_args.weights, cache_threshold=stage_args.cache_threshold,
                                     tp_size=stage_args.tp_size, host_tables=stage_args.tables(),
                                     compile=stage_args.compile_config(), niceness=args.replica_niceness,
                                     vae_tiling=stage is PipelineStage.DECODE and resolve_tiling(stage_args.vae_tiling, facts),
                                     vae_tile_px=stage_args.vae_tile_px)
        if stage is PipelineStage.DENOISE and loras:
            configs[stage] = dataclasses.replace(configs[stage], loras=loras,
                                                 lora_device_budget=args.lora_budget_bytes())
    return configs


def _cluster_has_gpus() -> bool:
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1


def tp_options(name: str, options: Mapping, stage: StageArgs) -> dict:
    """A stage's Serve options with its ranks' placement-group bundles (unchanged at tp_size 1).

    One bundle per rank, strict pack (one node, so the ranks' collectives stay on its links);
    rank i runs in bundle i; the replica itself sits in bundle 0 with no GPU of its own.
    """
    options = dict(options)
    if stage.tp_size == 1:
        return options
    actor = dict(options.get("ray_actor_options") or {})
    gpu = stage.tp_device == "gpu" or (stage.tp_device == "auto" and _cluster_has_gpus())
    # A bundle must ask for something: a hundredth of a CPU when the replicas ask for none (tests).
    rank_cpus = max(float(actor.get("num_cpus", 0.0)), 0.01)
    bundles = [{"CPU": rank_cpus, **({"GPU": 1} if gpu else {})} for _ in range(stage.tp_size)]
    bundles[0]["CPU"] += float(actor.get("num_cpus", 0.0))
    if actor.get("accelerator_type"):  # Ray asks 0.001 of this resource for the replica (bundle 0) and each rank
        for bundle in bundles:
            bundle[f"accelerator_type:{actor['accelerator_type']}"] = 0.002 if bundle is bundles[0] else 0.001
    actor["num_gpus"] = 0  # the ranks hold the GPUs, one whole GPU each
    logger.info("%s: tp_size %d -> %d bundles %s, STRICT_PACK", name, stage.tp_size, len(bundles), bundles[1:2])
    options.update(ray_actor_options=actor, placement_group_bundles=bundles, placement_group_strategy="STRICT_PACK")
    return options


def build_app(args: AppArgs | dict) -> Application:
    """The application (Serve's builder: exactly one parameter); a config file's ``deployments`` then
    override the options set here, by deployment name."""
    return build_app_with(args, {})


def build_app_with(args: AppArgs | dict, options: Mapping[str, Mapping]) -> Application:
    """:func:`build_app` with per-deployment Serve options over the defaults (what a config file's
    ``deployments`` do, for Python callers: ``{"Denoiser": {"num_replicas": 2, "ray_actor_options": ...}}``)."""
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    facts = read_family_traits(resolve_model_folder(args))
    check_weights(facts)  # a component a replica could not load fails the build, not each replica's start
    token = os.environ.get(args.api_token_env) if args.api_token_env else None
    if args.api_token_env and not token:
        raise ValueError(f"api_token_env names {args.api_token_env!r}, which is not set: refusing to start "
                         "without the configured authentication")
    model_id = args.model_id or pathlib.Path(facts.folder).name
    actor = {"num_cpus": args.replica_num_cpus}
    drain = dict(graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s, graceful_shutdown_wait_loop_s=0.5,
                 max_surge_percent=args.update_surge_percent)
    stage = dict(ray_actor_options=stage_actor_options(actor, args.replica_niceness), max_ongoing_requests=1,
                 max_queued_requests=args.stage_max_queued_requests, **drain)
    chosen = {"TextEncoder": stage, "Denoiser": {**stage, "max_ongoing_requests": args.batching.max_batch,
                                                 **router_options(args.routing, args.routing_stats_period_s)},
              "VaeDecoder": stage,
              "Ingress": dict(ray_actor_options=actor, max_ongoing_requests=args.ingress_max_ongoing_requests, **drain)}
    unknown = set(options) - set(chosen)
    if unknown:
        raise ValueError(f"options for unknown deployments {sorted(unknown)}; the app has {sorted(chosen)}")
    chosen = {name: {**defaults, **options.get(name, {})} for name, defaults in chosen.items()}
    for name, stage_args in (("TextEncoder", args.encoder), ("Denoiser", args.denoiser), ("VaeDecoder", args.decoder)):
        chosen[name] = tp_options(name, chosen[name], stage_args)
    chosen["Denoiser"] = work_autoscaling.with_policy(chosen["Denoiser"], args.denoiser_scales_on,
                                                      args.denoiser_target_work_s)
    dropped = work_autoscaling.dropped_policy("Denoiser", unplaced.deployed_overrides(args.app_name).get(
        "Denoiser", {}), args.denoiser_scales_on)
    if dropped is not None:
        logger.warning("%s: %s", args.app_name, dropped)
    logger.info("building %s: %s model %r from %s; offload modes encoder=%s denoiser=%s decoder=%s; "
                "host budgets encoder=%s denoiser=%s decoder=%s", args.app_name, facts.family.value, model_id,
                facts.folder, _mode(args.encoder), _mode(args.denoiser), _mode(args.decoder),
                args.encoder.host_memory_budget, args.denoiser.host_memory_budget,
                args.decoder.host_memory_budget)
    configs = stage_configs(args, facts)
    encoder = TextEncoder.options(**chosen["TextEncoder"]).bind(configs[PipelineStage.ENCODE])
    denoiser = Denoiser.options(**chosen["Denoiser"]).bind(configs[PipelineStage.DENOISE])
    decoder = VaeDecoder.options(**chosen["VaeDecoder"]).bind(configs[PipelineStage.DECODE])
    config = IngressConfig(args.app_name, model_id, facts, args.limits, token, args.retry_after_s,
                           tuple(args.cors_allow_origins), jobs=args.video_jobs, loras=served_loras(args, facts))
    unplaced.warn_if_unplaceable(args.app_name, chosen, autoscaler=args.cluster_autoscaler)
    return Ingress.options(**chosen["Ingress"]).bind(encoder, denoiser, decoder, config)
