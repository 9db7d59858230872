"""The KubeRay manifest with a tensor-parallel stage: valid against the CRDs and Serve's schema, and
its 2-GPU worker group can hold the strictly packed bundles build_app asks for."""
from __future__ import annotations

import json

import yaml

from deployments.app import AppArgs, tp_options
from tests.k8s.strict import CRD_DIR, closed, crd_errors, crd_schema, kuberay_rule_errors
from tests.k8s.test_manifests import _render_module, serve_config_errors

K8S = CRD_DIR.parent
MANIFEST = K8S / "tp" / "rayservice-wan14b-tp2.yaml"


def _load() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def test_the_tp_manifest_is_what_render_py_renders_and_validates_against_both_crds():
    render = _render_module()
    [variant] = render.TP_VARIANTS
    assert MANIFEST.read_text() == render.render(variant), "stale: run python k8s/render.py"
    manifest = _load()
    assert crd_errors(manifest, closed(crd_schema("ray.io_rayservices.yaml"))) == []
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "x"},
               "spec": manifest["spec"]["rayClusterConfig"]}
    assert crd_errors(cluster, closed(crd_schema("ray.io_rayclusters.yaml"))) == []
    assert kuberay_rule_errors(manifest["metadata"]["name"], manifest["spec"]["rayClusterConfig"]) == []
    assert serve_config_errors(yaml.safe_load(manifest["spec"]["serveConfigV2"])) == []


def test_the_tp_encoders_bundles_fit_one_pod_of_the_two_gpu_group():
    manifest = _load()
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    args = AppArgs.model_validate(app["args"])
    assert args.encoder.tp_size == 2 and args.encoder.tp_device == "gpu"
    [encoder] = [d for d in app["deployments"] if d["name"] == "TextEncoder"]
    options = tp_options("TextEncoder", encoder, args.encoder)
    bundles = options["placement_group_bundles"]
    assert options["placement_group_strategy"] == "STRICT_PACK" and len(bundles) == 2
    groups = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    fits = []
    for group in groups:
        start = group["rayStartParams"]
        node = {"CPU": float(start["num-cpus"]), "GPU": float(start["num-gpus"]),
                **json.loads(json.loads(start["resources"]))}
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == start["num-gpus"]
        need = {k: sum(b.get(k, 0) for b in bundles) for b in bundles for k in b}
        if all(node.get(k, 0) >= v for k, v in need.items()):
            fits.append(group["groupName"])
    assert fits == ["l4x2-48gb"], fits
