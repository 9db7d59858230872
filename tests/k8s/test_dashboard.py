"""The Grafana dashboard asks only for metrics the service exports (scraped from Ray's metrics agent)."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import yaml

from tests.deployments.conftest import service  # noqa: F401  (the module's one real-Ray app)


def _grafana_module():
    """k8s/grafana.py (k8s/ is a folder of manifests and their scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("k8s_grafana", Path(__file__).resolve().parents[2] / "k8s" / "grafana.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


grafana = _grafana_module()

# Ray's metrics agent exports what replicas recorded every few seconds (metrics_report_interval_ms).
SCRAPE_TIMEOUT_S = 120


def _queried_metrics() -> set[str]:
    """Every metric name a panel or template query names (every one is one Ray exports: ray_...)."""
    exprs = [t["expr"] for p in grafana.dashboard()["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in grafana.dashboard()["templating"]["list"] if v["type"] == "query"]
    names = {name for expr in exprs for name in re.findall(r"\bray_[A-Za-z0-9_:]+", expr)}
    assert names and all(re.search(r"\bray_", e) for e in exprs), "a query names no exported metric"
    return names


def _exported() -> set[str]:
    import ray

    names = set()
    for node in ray.nodes():
        if node["Alive"]:
            url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            names |= {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                      if line and not line.startswith("#")}
    return names


def test_the_committed_dashboard_and_configmap_are_what_grafana_py_renders():
    assert grafana.main(["--check"]) == 0, "run python k8s/grafana.py"
    configmap = yaml.safe_load(grafana.CONFIGMAP.read_text())
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["offload-serve.json"]) == grafana.dashboard()
    titles = [p["title"] for p in grafana.dashboard()["panels"]]
    for wanted in ("Requests per second by route", "Latency by route", "Queue wait", "Batch size",
                   "Denoising step time", "Bytes streamed per request", "Host bytes by tier",
                   "Device leases against capacity per GPU", "Pending replicas"):
        assert wanted in titles


def test_every_metric_a_dashboard_query_names_is_exported_by_the_running_service(service):  # noqa: F811
    base, headers = service
    with httpx.Client(base_url=base, headers=headers, timeout=120) as client:
        response = client.post("/v1/images/generations", json={"prompt": "a fox", "size": "16x16", "seed": 1})
        assert response.status_code == 200, response.text
    wanted = _queried_metrics()
    deadline, missing = time.monotonic() + SCRAPE_TIMEOUT_S, wanted
    while missing and time.monotonic() < deadline:
        exported = _exported()
        missing = wanted - exported
        if missing:
            time.sleep(3)
    assert not missing, (f"the dashboard queries metrics the service does not export: {sorted(missing)}; "
                         f"exported ray_serve/offload ones: {sorted(n for n in exported if 'serve' in n)}")
