"""The Grafana dashboard and its ConfigMap are what k8s/grafana.py renders; every query names a metric Ray
exports (ray_...). That the running service exports each one is checked against the tiny service in
tests/deployments/ingress/test_service.py, on the app that module runs anyway (no second one here)."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import yaml


def _grafana_module():
    """k8s/grafana.py (k8s/ is a folder of manifests and their scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("k8s_grafana", Path(__file__).resolve().parents[2] / "k8s" / "grafana.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


grafana = _grafana_module()


def test_the_committed_dashboard_and_configmap_are_what_grafana_py_renders():
    assert grafana.main(["--check"]) == 0, "run python k8s/grafana.py"
    configmap = yaml.safe_load(grafana.CONFIGMAP.read_text())
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["offload-serve.json"]) == grafana.dashboard()
    titles = [p["title"] for p in grafana.dashboard()["panels"]]
    for wanted in ("Requests per second by route", "Latency by route", "Queue wait", "Batch size",
                   "Denoising step time", "Bytes streamed per request", "Host bytes by tier",
                   "Device leases against capacity per GPU", "Pending replicas", "Denoising step time per GPU type",
                   "Queued work per GPU type", "Queued requests per GPU type",
                   "Predicted vs actual finish per GPU type"):
        assert wanted in titles


def queried_metrics() -> set[str]:
    """Every metric name a panel or template query names (every one is one Ray exports: ray_...)."""
    exprs = [t["expr"] for p in grafana.dashboard()["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in grafana.dashboard()["templating"]["list"] if v["type"] == "query"]
    names = {name for expr in exprs for name in re.findall(r"\bray_[A-Za-z0-9_:]+", expr)}
    assert names and all(re.search(r"\bray_", e) for e in exprs), "a query names no exported metric"
    return names


def test_the_mixed_fleet_panels_split_every_query_by_gpu_type():
    panels = [p for p in grafana.dashboard()["panels"] if p["title"].endswith("per GPU type")]
    assert len(panels) == 4
    for panel in panels:
        for target in panel["targets"]:
            assert re.search(r"by \((le, )?gpu_type\)", target["expr"]) and "{{gpu_type}}" in target["legendFormat"], \
                (panel["title"], target["expr"])
