"""The operators' Grafana dashboard, and the ConfigMap that hands it to Grafana's dashboard sidecar.

Writes ``k8s/grafana/offload-serve.json`` (import it by hand, or let the sidecar load it) and
``k8s/grafana/configmap.yaml`` (a ConfigMap labelled ``grafana_dashboard: "1"``, the label the
Grafana Helm chart's and kube-prometheus-stack's sidecar watch by default). The panels are the
table below; every query names metrics as Ray's metrics agent exports them (Ray prefixes the
application's own metrics with ``ray_``). ``tests/deployments/ingress/test_service.py`` scrapes what
Ray exports for the running tiny service and fails when a query names a metric it does not export.

    python k8s/grafana.py            # write both files
    python k8s/grafana.py --check    # fail if either is stale
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

K8S_DIR = Path(__file__).resolve().parent
DASHBOARD = K8S_DIR / "grafana" / "offload-serve.json"
CONFIGMAP = K8S_DIR / "grafana" / "configmap.yaml"
UID = "offload-serve"
# Ray's Serve app label is "application"; the manifests name the app offload-serve.
APP = 'application=~"$application"'


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # Grafana unit id
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str


def _quantiles(metric: str, by: str, where: str = "") -> tuple[tuple[str, str], ...]:
    sel = f"{{{where}}}" if where else ""
    return tuple((f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{sel}[$__rate_interval])))",
                  f"p{int(q * 100)} {{{{{by}}}}}") for q in (0.5, 0.95))


def _mean(metric: str, by: str) -> tuple[str, str]:
    return (f"sum by ({by}) (rate({metric}_sum[$__rate_interval])) / "
            f"sum by ({by}) (rate({metric}_count[$__rate_interval]))", f"mean {{{{{by}}}}}")


PANELS: tuple[Panel, ...] = (
    Panel("Requests per second by route", "reqps",
          ((f"sum by (route, status_code) (rate(ray_serve_num_http_requests_total{{{APP}}}[$__rate_interval]))",
            "{{route}} {{status_code}}"),),
          "Serve's proxy: every HTTP request the API answered, by route and status code."),
    Panel("Latency by route", "ms", _quantiles("ray_serve_http_request_latency_ms", "route", APP),
          "Serve's proxy: end-to-end HTTP latency (ms), p50 and p95 per route."),
    Panel("Queue wait", "s",
          (*_quantiles("ray_offload_serve_batch_queue_wait_seconds", "deployment"),
           (f"sum by (deployment) (ray_serve_deployment_queued_queries{{{APP}}})", "queued {{deployment}}")),
          "The Denoiser's wait for room in a compatible batch (s), and requests queued at each deployment "
          "by Serve's routers."),
    Panel("Batch size", "short",
          (_mean("ray_offload_serve_batch_size", "replica"),
           ("histogram_quantile(0.95, sum by (le) (rate(ray_offload_serve_batch_size_bucket[$__rate_interval])))",
            "p95")),
          "Requests sharing one Denoiser forward (one stream of the weights): the higher, the fewer bytes "
          "each request moves."),
    Panel("Denoising step time", "s", _quantiles("ray_offload_serve_step_seconds", "replica"),
          "One batched Denoiser forward and its scheduler steps."),
    # Mixed fleets: one Denoiser deployment over several GPU types (k8s/rayservice-mixed.yaml). The
    # replicas tag their step times and queues with their GPU type; the request router (in the ingress)
    # tags its predicted and actual finish times with the chosen replica's.
    Panel("Denoising step time per GPU type", "s", _quantiles("ray_offload_serve_step_seconds", "gpu_type"),
          "One batched Denoiser forward on each GPU type: the speeds the router and the autoscaler weigh "
          "each replica's queue by."),
    Panel("Queued work per GPU type", "s",
          (("sum by (gpu_type) (ray_offload_serve_queued_work_seconds)", "work {{gpu_type}}"),),
          "Predicted seconds until the Denoiser replicas of each GPU type are idle, each replica's queue at "
          "its own measured step times: what the autoscaling policy sums (target_work_s per replica)."),
    Panel("Queued requests per GPU type", "short",
          (("sum by (gpu_type) (ray_offload_serve_queued_requests)", "requests {{gpu_type}}"),),
          "Requests the Denoiser replicas of each GPU type hold (running batch and queue); those waiting at "
          "the handles are in Queue wait."),
    Panel("Predicted vs actual finish per GPU type", "s",
          (("sum by (gpu_type) (rate(ray_offload_serve_route_predicted_finish_seconds_sum[$__rate_interval])) / "
            "sum by (gpu_type) (rate(ray_offload_serve_route_predicted_finish_seconds_count[$__rate_interval]))",
            "predicted {{gpu_type}}"),
           ("sum by (gpu_type) (rate(ray_offload_serve_route_actual_finish_seconds_sum[$__rate_interval])) / "
            "sum by (gpu_type) (rate(ray_offload_serve_route_actual_finish_seconds_count[$__rate_interval]))",
            "actual {{gpu_type}}"),
           *_quantiles("ray_offload_serve_route_prediction_error_ratio", "gpu_type")),
          "The request router's predicted finish for the replica it chose against the request's actual one "
          "(means, s), and |predicted - actual| / actual (p50, p95: a ratio, not seconds)."),
    Panel("Bytes streamed per request", "bytes", (_mean("ray_offload_serve_bytes_streamed_per_request", "stage"),),
          "Host->device weight bytes per stage call: the link's cost of each request."),
    Panel("Host bytes by tier", "bytes",
          (("sum by (tier) (ray_offload_serve_host_bytes)", "{{tier}}"),),
          "Weights held in host memory by every replica, by tier: pinned (page-locked, staging "
          "included), pageable, mapped (checkpoint file), shared (the node weight store, attached)."),
    Panel("Device leases against capacity per GPU", "bytes",
          (("sum by (gpu) (ray_offload_serve_device_leased_bytes)", "leased {{gpu}}"),
           ("max by (gpu) (ray_offload_serve_gpu_capacity_bytes)", "capacity {{gpu}}")),
          "What the replicas on each GPU leased from their node's ledger (standing + call reservations) "
          "against what the ledger may lease on that GPU."),
    Panel("Pending replicas", "short",
          (("sum by (deployment) (ray_offload_serve_pending_replicas)", "{{deployment}}"),),
          "Stage replicas Ray has not placed yet (no node has the GPU share they ask for); see GET "
          "/v1/residency -> pending for the reason."),
)


def dashboard() -> dict:
    panels = []
    for i, panel in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": panel.title, "description": panel.description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, (expr, legend) in enumerate(panel.queries)],
        })
    return {
        "uid": UID, "title": "offload-serve", "tags": ["offload-serve", "ray-serve"], "timezone": "browser",
        "schemaVersion": 39, "version": 1, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "application", "type": "query", "label": "Serve application",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": "label_values(ray_serve_num_http_requests_total, application)",
             "includeAll": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}},
        ]},
        "panels": panels,
    }


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


class _Literal(str):
    """A string dumped as a YAML block literal: the JSON stays readable (and diffable) in the ConfigMap."""


yaml.SafeDumper.add_representer(_Literal, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", str(v), style="|"))


def configmap() -> str:
    body = {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "offload-serve-grafana-dashboard",
                         "labels": {"grafana_dashboard": "1", "app.kubernetes.io/name": "offload-serve"}},
            "data": {"offload-serve.json": _Literal(dashboard_json())}}
    return ("# Generated by k8s/grafana.py: Grafana's dashboard sidecar loads it (label grafana_dashboard=1).\n"
            + yaml.safe_dump(body, sort_keys=False, width=120))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a committed file is stale")
    args = parser.parse_args(argv)
    files = {DASHBOARD: dashboard_json(), CONFIGMAP: configmap()}
    stale = [path.name for path, text in files.items() if not path.is_file() or path.read_text() != text]
    if args.check:
        if stale:
            print(f"stale (run python k8s/grafana.py): {', '.join(stale)}", file=sys.stderr)
            return 1
        return 0
    for path, text in files.items():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
