"""The KubeRay manifests: valid against the RayService CRD and Ray Serve's schema, strictly, and
consistent with the GPU fleet, the service's deployments and the host budgets of the real models."""
from __future__ import annotations

import copy
import importlib.util
import itertools
import json
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch
import yaml
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from offload_core.layout import KNOWN_LAYER_GROUPS, layer_parameters, plan_layer_layout
from offload_core.planner.real_models import (
    UnknownModel,
    component_spec,
    meta_component,
)
from tests.k8s.strict import (
    CRD_DIR,
    closed,
    crd_errors,
    crd_schema,
    kuberay_rule_errors,
    unknown_keys,
)

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
GI = 2**30
STAGES = {"TextEncoder", "Denoiser", "VaeDecoder"}
STAGE_COMPONENTS = {"TextEncoder": ("text_encoder", "text_encoder_2"), "Denoiser": ("transformer",), "VaeDecoder": ("vae",)}
# Host RAM a stage replica holds besides its weights: torch + CUDA context + Ray worker (~2.5 GB
# RSS measured for a CUDA torch worker) rounded up.
REPLICA_OVERHEAD = 3 * GI


def _load(path: Path) -> dict:
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert len(documents) == 1 and documents[0]["kind"] == "RayService", f"{path.name}: one RayService per file"
    return documents[0]


def _serve(manifest: dict) -> dict:
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


@lru_cache(maxsize=None)
def _schema(crd_file: str) -> dict:
    return closed(crd_schema(crd_file))


def serve_config_errors(config: dict) -> list[str]:
    """Unknown keys anywhere (autoscaling_config included), then Serve's own type validation."""
    errors = [f"unknown key {k}" for k in unknown_keys(config, ServeDeploySchema)]
    for app in config.get("applications", []):
        for deployment in app.get("deployments", []):
            if isinstance(deployment.get("autoscaling_config"), dict):
                errors += [f"unknown key {deployment['name']}.autoscaling_config.{k}"
                           for k in unknown_keys(deployment["autoscaling_config"], AutoscalingConfig)]
    if not errors:
        ServeDeploySchema.model_validate(config)  # raises pydantic.ValidationError with the reason
    return errors


@pytest.fixture(params=MANIFESTS, ids=lambda p: p.name)
def manifest(request) -> dict:
    return _load(request.param)


def test_there_are_manifests_and_the_crd_copies_are_in_k8s():
    assert len(MANIFESTS) >= 1
    assert {p.name for p in CRD_DIR.glob("*.yaml")} == {"ray.io_rayservices.yaml", "ray.io_rayclusters.yaml"}


def test_crd_copies_match_a_kuberay_checkout_beside_the_repository():
    shared = REPO.parent / "shared" / "kuberay"  # where the maintainers keep KubeRay's CRDs of crds/SOURCE
    if not shared.is_dir():
        pytest.skip("no KubeRay checkout beside the repository to compare with; the committed copies in "
                    "k8s/crds (KubeRay commit in k8s/crds/SOURCE) are what the tests use")
    for name in ("ray.io_rayservices.yaml", "ray.io_rayclusters.yaml"):
        assert (CRD_DIR / name).read_bytes() == (shared / name).read_bytes(), f"k8s/crds/{name} is stale"


def _render_module():
    spec = importlib.util.spec_from_file_location("k8s_render", K8S / "render.py")
    render = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = render  # dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(render)
    finally:
        del sys.modules[spec.name]
    return render


def test_manifests_are_what_render_py_renders():
    render = _render_module()
    assert {v.file_name for v in render.VARIANTS} == {p.name for p in MANIFESTS}
    for variant in render.VARIANTS:
        assert (K8S / variant.file_name).read_text() == render.render(variant), "stale: run python k8s/render.py"


def test_manifest_validates_strictly_against_the_rayservice_crd(manifest):
    assert crd_errors(manifest, _schema("ray.io_rayservices.yaml")) == []
    # The embedded cluster spec is also a valid RayCluster spec (same types, own CRD).
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "x"},
               "spec": manifest["spec"]["rayClusterConfig"]}
    assert crd_errors(cluster, _schema("ray.io_rayclusters.yaml")) == []


def test_manifest_passes_kuberays_operator_side_validation(manifest):
    assert kuberay_rule_errors(manifest["metadata"]["name"], manifest["spec"]["rayClusterConfig"]) == []


def test_serve_config_validates_strictly_against_ray_serves_schema(manifest):
    assert serve_config_errors(_serve(manifest)) == []


def test_serve_config_builds_the_service_app_with_valid_args_and_its_deployment_names(manifest):
    from deployments.app import AppArgs
    from deployments.ingress.deployment import Ingress
    from deployments.replica.stages import Denoiser, TextEncoder, VaeDecoder

    (app,) = _serve(manifest)["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    args = AppArgs.model_validate(app["args"])  # extra="forbid": a typo'd arg fails here
    assert args.app_name == app["name"], "the residency board is named after the Serve app"
    names = {d["name"] for d in app["deployments"]}
    assert names == {Ingress.name, TextEncoder.name, Denoiser.name, VaeDecoder.name}


def test_the_denoisers_concurrency_is_its_batch_as_build_app_sets_it(manifest):
    from deployments.app import AppArgs

    (app,) = _serve(manifest)["applications"]
    args = AppArgs.model_validate(app["args"])
    options = {d["name"]: d for d in app["deployments"]}
    assert options["Denoiser"]["max_ongoing_requests"] == args.batching.max_batch >= 2
    assert all(options[name]["max_ongoing_requests"] >= 1 for name in ("TextEncoder", "VaeDecoder"))


def _worker_groups(manifest: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def _accelerator(group: dict) -> str:
    resources = json.loads(json.loads(group["rayStartParams"]["resources"]))
    (key,) = [k for k in resources if k.startswith("accelerator_type:")]
    return key.split(":", 1)[1]


def test_cluster_has_a_gpu_less_head_and_one_zero_scaled_worker_group_per_gpu_type(manifest):
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert all("nvidia.com/gpu" not in c["resources"]["limits"] for c in head["template"]["spec"]["containers"])
    groups = _worker_groups(manifest)
    products = [g["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] for g in groups.values()]
    assert len(groups) >= 5 and len(set(products)) == len(products), "one group per GPU product"
    assert len({_accelerator(g) for g in groups.values()}) == len(groups)
    for name, group in groups.items():
        start, spec = group["rayStartParams"], group["template"]["spec"]
        (container,) = spec["containers"]
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        assert group["maxReplicas"] >= 1 and group["replicas"] == group["minReplicas"] >= 0
        # A group kept up (minReplicas > 0) hosts a pinned stage that keeps a replica anyway; every
        # other group scales from zero, or its GPUs idle at no one's request.
        if group["minReplicas"] > 0:
            assert _accelerator(group) in _kept_up_types(manifest), f"{name} must scale from zero"
        assert limits == requests, f"{name}: requests == limits, or the ledger budgets a cgroup that can shrink"
        assert limits["nvidia.com/gpu"] == start["num-gpus"] == "1"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        memory = _gi(limits["memory"])
        store = int(start["object-store-memory"])
        # Ray's default store is 30 % of memory; explicit and small here (stage outputs are MBs).
        assert 0 < store <= 0.1 * memory, f"{name}: object store {store / GI:.1f} GiB of {memory / GI:.0f} GiB"
        (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert _gi(shm["emptyDir"]["sizeLimit"]) >= store, f"{name}: /dev/shm must hold the object store"
        assert group["labels"]["offload-serve/gpu-type"] == _accelerator(group)


def _kept_up_types(manifest: dict) -> set[str]:
    """GPU types a stage pinned to one type keeps at least one replica on (min_replicas >= 1)."""
    (app,) = _serve(manifest)["applications"]
    return {d["ray_actor_options"]["accelerator_type"] for d in app["deployments"]
            if d["name"] in STAGES and "accelerator_type" in d["ray_actor_options"]
            and d["autoscaling_config"]["min_replicas"] >= 1}


def spanned_types(options: dict) -> tuple[str, ...]:
    """The GPU types a stage's ray_actor_options let its replicas land on: its accelerator_type, or
    the ``in(...)`` of its label selector over the groups' offload-serve/gpu-type label."""
    if "accelerator_type" in options:
        return (options["accelerator_type"],)
    selector = options["label_selector"]["offload-serve/gpu-type"]
    assert selector.startswith("in(") and selector.endswith(")"), selector
    return tuple(selector[3:-1].split(","))


def _gi(quantity: str) -> int:
    assert quantity.endswith("Gi"), f"memory quantities are written in Gi, got {quantity!r}"
    return int(quantity[:-2]) * GI


@lru_cache(maxsize=None)
def _weight_bytes(real_model: str, stage: str, dtype: str) -> int:
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    total = 0
    for component in STAGE_COMPONENTS[stage]:
        try:
            component_spec(real_model, component)
        except UnknownModel:
            continue  # Wan has no text_encoder_2
        total += sum(p.numel() for p in meta_component(real_model, component).parameters()) * itemsize
    return total


def _stage_placements(manifest: dict) -> list[tuple[str, dict, dict]]:
    (app,) = _serve(manifest)["applications"]
    by_type = {_accelerator(g): g for g in _worker_groups(manifest).values()}
    placed = []
    for d in app["deployments"]:
        if d["name"] in STAGES:
            options = d["ray_actor_options"]
            assert options["num_gpus"] > 0, f"{d['name']} without a GPU would land on the head"
            for gpu_type in spanned_types(options):  # a stage over several types: once per group
                assert gpu_type in by_type, f"{d['name']}: no worker group offers {gpu_type}"
                placed.append((d["name"], d, by_type[gpu_type]))
    assert {name for name, _, _ in placed} == STAGES
    return placed


def test_every_node_can_host_the_weights_of_any_replica_mix_its_gpu_admits(manifest):
    real_model = manifest["metadata"]["annotations"]["offload-serve/real-model"]
    dtype = _serve(manifest)["applications"][0]["args"]["dtype"]
    placed = _stage_placements(manifest)
    for group_name in {g["groupName"] for _, _, g in placed}:
        here = [(name, d) for name, d, g in placed if g["groupName"] == group_name]
        group = _worker_groups(manifest)[group_name]
        memory = _gi(group["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"])
        # offload_core's host budget: cgroup limit - reserve (max(5 %, 2 GiB)) - Ray's object store.
        spendable = memory - max(memory // 20, 2 * GI) - int(group["rayStartParams"]["object-store-memory"])
        caps = [min(int(1 // d["ray_actor_options"]["num_gpus"]), d["autoscaling_config"]["max_replicas"])
                for _, d in here]
        worst = 0
        for counts in itertools.product(*(range(c + 1) for c in caps)):
            gpus = sum(n * d["ray_actor_options"]["num_gpus"] for n, (_, d) in zip(counts, here))
            if gpus <= 1.0 + 1e-9:
                worst = max(worst, sum(n * (_weight_bytes(real_model, name, dtype) + REPLICA_OVERHEAD)
                                       for n, (name, _) in zip(counts, here)))
        assert worst <= spendable, (f"{group_name}: replicas its GPU admits hold {worst / GI:.1f} GiB of host "
                                    f"memory, the node ledger can spend {spendable / GI:.1f} GiB")


@lru_cache(maxsize=None)
def _streamed_layer_gib(real_model: str, stage: str, dtype: str) -> float:
    """Bytes of a stage's streamable layers in offload_core's flat layout: one node store's size."""
    total = 0
    for component in STAGE_COMPONENTS[stage]:
        try:
            component_spec(real_model, component)
        except UnknownModel:
            continue
        module = meta_component(real_model, component).to(getattr(torch, dtype))
        groups = getattr(module, "offload_layer_groups", None) or KNOWN_LAYER_GROUPS.get(type(module).__name__, ())
        for group in groups:
            for i, layer in enumerate(module.get_submodule(group)):
                total += plan_layer_layout(f"{group}.{i}", [(n, p.data) for n, p in layer_parameters(layer)]).nbytes
    return total / GI


def test_the_shared_layer_table_matches_the_real_models_streamed_layers():
    render = _render_module()
    for (real_model, stage), gib in render.SHARED_LAYER_GIB.items():
        assert abs(_streamed_layer_gib(real_model, stage, "bfloat16") - gib) < 0.01, (real_model, stage)


def test_each_worker_groups_memory_backed_dev_shm_holds_its_object_store_and_one_copy_per_streamed_stage(manifest):
    real_model = manifest["metadata"]["annotations"]["offload-serve/real-model"]
    (app,) = _serve(manifest)["applications"]
    modes = {"TextEncoder": "encoder", "Denoiser": "denoiser", "VaeDecoder": "decoder"}
    for group in _worker_groups(manifest).values():
        spec = group["template"]["spec"]
        (dshm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert dshm["emptyDir"]["medium"] == "Memory", "node weight stores must live in RAM"
        (container,) = spec["containers"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        streamed = sum(_streamed_layer_gib(real_model, name, app["args"]["dtype"])
                       for name, d, g in _stage_placements(manifest)
                       if g["groupName"] == group["groupName"] and app["args"][modes[name]]["offload_mode"] != "speed")
        need = int(group["rayStartParams"]["object-store-memory"]) / GI + streamed
        size = _gi(dshm["emptyDir"]["sizeLimit"]) / GI
        assert need <= size < _gi(container["resources"]["limits"]["memory"]) / GI, (group["groupName"], need, size)


def test_stages_in_speed_mode_fit_their_gpu_share(manifest):
    real_model = manifest["metadata"]["annotations"]["offload-serve/real-model"]
    (app,) = _serve(manifest)["applications"]
    modes = {"TextEncoder": "encoder", "Denoiser": "denoiser", "VaeDecoder": "decoder"}
    gpu_gb = {g["groupName"]: int(g["labels"]["offload-serve/gpu-memory-gb"]) for g in _worker_groups(manifest).values()}
    for name, d, group in _stage_placements(manifest):
        if app["args"][modes[name]]["offload_mode"] != "speed":
            continue
        share = d["ray_actor_options"]["num_gpus"] * gpu_gb[group["groupName"]] * 10**9
        weights = _weight_bytes(real_model, name, app["args"]["dtype"])
        assert weights < 0.8 * share, f"{name}: speed keeps {weights / 1e9:.1f} GB resident in a {share / 1e9:.0f} GB share"


# --- negative tests: a typo must fail each validation -------------------------------------------

def _first_manifest() -> dict:
    return _load(MANIFESTS[0])


def test_a_typo_in_a_worker_group_key_fails_crd_validation():
    bad = _first_manifest()
    group = bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["minReplica"] = group.pop("minReplicas")
    errors = crd_errors(bad, _schema("ray.io_rayservices.yaml"))
    assert any("minReplica'" in e and "workerGroupSpecs/0" in e for e in errors), errors


def test_a_typo_in_the_pod_template_fails_crd_validation():
    bad = _first_manifest()
    spec = bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    spec["nodeSelecter"] = spec.pop("nodeSelector")
    assert any("nodeSelecter" in e for e in crd_errors(bad, _schema("ray.io_rayservices.yaml")))


def test_a_wrongly_typed_value_fails_crd_validation():
    bad = _first_manifest()
    bad["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] = "yes"
    assert any("enableInTreeAutoscaling" in e for e in crd_errors(bad, _schema("ray.io_rayservices.yaml")))


def test_labels_in_ray_start_params_fail_kuberays_validation():
    bad = _first_manifest()
    group = bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["rayStartParams"]["labels"] = "gpu=L4"
    group["resources"] = {"GPU": "1"}
    errors = kuberay_rule_errors(bad["metadata"]["name"], bad["spec"]["rayClusterConfig"])
    assert any("rayStartParams['labels']" in e for e in errors) and any("both" in e for e in errors), errors


@pytest.mark.parametrize("where,typo", [
    ("deployment", "max_ongoing_request"),
    ("autoscaling_config", "min_replica"),
    ("ray_actor_options", "num_gpu"),
    ("application", "import_pth"),
    ("top", "http_option"),
])
def test_a_typo_in_serve_config_v2_is_an_error(where, typo):
    config = _serve(_first_manifest())
    app = config["applications"][0]
    deployment = next(d for d in app["deployments"] if d["name"] == "Denoiser")
    target = {"deployment": deployment, "autoscaling_config": deployment["autoscaling_config"],
              "ray_actor_options": deployment["ray_actor_options"], "application": app, "top": config}[where]
    target[typo] = copy.deepcopy(next(iter(target.values())))
    errors = serve_config_errors(config)
    assert any(e.endswith(typo) for e in errors), errors


def test_a_wrongly_typed_serve_value_fails_serves_own_validation():
    config = _serve(_first_manifest())
    config["applications"][0]["deployments"][1]["max_ongoing_requests"] = "many"
    with pytest.raises(ValueError, match="max_ongoing_requests"):
        serve_config_errors(config)


def test_a_typo_in_the_app_args_fails_app_args_validation():
    from pydantic import ValidationError

    from deployments.app import AppArgs

    args = dict(_serve(_first_manifest())["applications"][0]["args"])
    args["dtyp"] = args.pop("dtype")
    with pytest.raises(ValidationError, match="dtyp"):
        AppArgs.model_validate(args)


def test_the_denoiser_names_the_work_policy_its_app_scales_it_on(manifest):
    # The config file's autoscaling_config replaces build_app's whole: without the policy named here
    # the Denoiser would scale on ongoing requests, whatever AppArgs.denoiser_scales_on says.
    from deployments.app import AppArgs
    from deployments.capacity.work_autoscaling import dropped_policy

    (app,) = _serve(manifest)["applications"]
    args = AppArgs.model_validate(app["args"])
    [denoiser] = [d for d in app["deployments"] if d["name"] == "Denoiser"]
    assert dropped_policy("Denoiser", denoiser, args.denoiser_scales_on) is None
    assert AutoscalingConfig(**denoiser["autoscaling_config"]).policy.get_policy().__name__ == "WorkPolicy"
