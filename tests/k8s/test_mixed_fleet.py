"""The mixed-fleet RayService (k8s/rayservice-mixed.yaml): one Denoiser deployment over two GPU worker
groups of different types, each group with its own min/max, while the encoder stays pinned to one type.
CRD strictness, Serve's schema and the host-memory checks run on it with every manifest
(tests/k8s/test_manifests.py); this module pins what makes it mixed."""
from __future__ import annotations

import json

import yaml

from tests.k8s.test_manifests import K8S, _render_module, spanned_types

MANIFEST = K8S / "rayservice-mixed.yaml"


def _load() -> tuple[dict, dict[str, dict], dict[str, dict]]:
    manifest = yaml.safe_load(MANIFEST.read_text())
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    deployments = {d["name"]: d for d in app["deployments"]}
    groups = {g["labels"]["offload-serve/gpu-type"]: g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
              if g["rayStartParams"]["num-gpus"] == "1"}
    return app, deployments, groups


def _pinned_types(options: dict) -> set[str]:
    """Accelerator types the options pin, by accelerator_type or by its resource."""
    resources = options.get("resources") or {}
    return ({options["accelerator_type"]} if "accelerator_type" in options else set()) | {
        k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")}


def test_the_denoiser_asks_for_a_gpu_of_either_type_not_one_accelerator_type():
    _, deployments, groups = _load()
    options = deployments["Denoiser"]["ray_actor_options"]
    assert _pinned_types(options) == set(), f"the Denoiser pins {_pinned_types(options)}: it cannot span groups"
    assert options["num_gpus"] == 1.0
    spanned = spanned_types(options)
    assert set(spanned) == {"L4", "H100"}
    for gpu_type in spanned:  # each type is a group's Ray node label, so the selector can match a node
        assert groups[gpu_type]["labels"]["offload-serve/gpu-type"] == gpu_type


def test_the_encoder_and_decoder_are_pinned_to_the_l4s():
    _, deployments, groups = _load()
    for name in ("TextEncoder", "VaeDecoder"):
        options = deployments[name]["ray_actor_options"]
        assert _pinned_types(options) == {"L4"} and "label_selector" not in options, options
        resources = json.loads(json.loads(groups["L4"]["rayStartParams"]["resources"]))
        assert resources == {"accelerator_type:L4": 1}, "the L4 group offers what the pinned stages ask for"


def test_both_gpu_groups_exist_with_their_own_min_and_max():
    _, deployments, groups = _load()
    bounds = {t: (groups[t]["minReplicas"], groups[t]["maxReplicas"]) for t in ("L4", "H100")}
    assert bounds == {"L4": (1, 6), "H100": (0, 2)}
    assert all(groups[t]["replicas"] == groups[t]["minReplicas"] for t in bounds)
    # The other types of the fleet stay declared, from zero (the same cluster can host any variant).
    assert all(g["minReplicas"] == 0 for t, g in groups.items() if t not in bounds)
    # The Denoiser's maximum fits the two groups' nodes (one whole GPU per replica).
    assert deployments["Denoiser"]["autoscaling_config"]["max_replicas"] <= sum(high for _, high in bounds.values())


def test_the_denoiser_plans_in_each_gpus_fleet_profile_mode():
    from deployments.app import AppArgs

    app, _, _ = _load()
    args = AppArgs.model_validate(app["args"])
    assert args.denoiser.offload_mode is None, "a fixed mode would be one type's choice on both"
    assert args.encoder.offload_mode is not None


def test_the_manifest_is_a_render_variant_with_the_spanning_denoiser():
    render = _render_module()
    [variant] = [v for v in render.VARIANTS if v.file_name == MANIFEST.name]
    [denoiser] = [s for s in variant.stages if s.deployment == "Denoiser"]
    assert denoiser.spans and denoiser.placement_options() == {
        "label_selector": {"offload-serve/gpu-type": "in(L4,H100)"}}
    assert MANIFEST.read_text() == render.render(variant)
