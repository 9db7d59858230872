"""Every Ray container in every RayService manifest has its startup, liveness and readiness probes,
and their timings keep a start-up that loads tens of GB a readiness wait, never a liveness kill."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml")) + sorted(K8S.glob("tp/*.yaml"))
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
AGENT_PORT = 52365  # Ray's default dashboard agent port: where /api/healthz answers
# A worker joins through `ray start`, which waits up to 600 s for the head's GCS on KubeRay; and a
# node busy copying tens of GB may answer its health slowly. Neither may end in a restart.
MIN_STARTUP_S = 600
MIN_LIVENESS_S = 600


def _containers(manifest: dict) -> list[tuple[str, dict, dict]]:
    """(group, its rayStartParams, container) for the head and every worker group."""
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]
    return [(name, group["rayStartParams"], container)
            for name, group in groups for container in group["template"]["spec"]["containers"]]


def _serve_port(manifest: dict) -> int:
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])["http_options"]["port"]


def _asks(probe: dict) -> str:
    """What a probe requests, as one string: its httpGet as a URL, or its exec command."""
    if "httpGet" in probe:
        return f"http://localhost:{probe['httpGet']['port']}{probe['httpGet']['path']}"
    return " ".join(probe["exec"]["command"])


@pytest.fixture(params=MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def manifest(request) -> dict:
    return yaml.safe_load(request.param.read_text())


def test_there_are_manifests_with_workers():
    assert len(MANIFESTS) >= 4 and any(p.parent.name == "tp" for p in MANIFESTS)


def test_every_ray_container_has_all_three_probes(manifest):
    for group, _, container in _containers(manifest):
        missing = [p for p in PROBES if p not in container]
        assert not missing, f"{group}: {container['name']} has no {missing} (KubeRay would inject its own)"


def test_startup_and_liveness_ask_rays_node_health_only_with_room_for_a_long_start(manifest):
    for group, start, container in _containers(manifest):
        agent = int(start.get("dashboard-agent-listen-port", AGENT_PORT))
        for name, least in (("startupProbe", MIN_STARTUP_S), ("livenessProbe", MIN_LIVENESS_S)):
            probe = container[name]
            # Never the application or the proxy: a replica loading its weights would be restarted.
            assert _asks(probe) == f"http://localhost:{agent}/api/healthz", (group, name, _asks(probe))
            tolerance = probe["periodSeconds"] * probe["failureThreshold"] + probe.get("initialDelaySeconds", 0)
            assert tolerance >= least, f"{group}: {name} acts after {tolerance} s of failures, under {least} s"
            assert probe["timeoutSeconds"] >= 5, f"{group}: {name} times out a busy node's answer"


def test_the_heads_readiness_never_waits_for_the_application(manifest):
    # KubeRay deploys serveConfigV2 only once the head is ready: a head waiting for /health never deploys.
    (head,) = [c for group, _, c in _containers(manifest) if group == "head"]
    asks = _asks(head["readinessProbe"])
    assert "/health" not in asks.replace("/api/healthz", "") and "/-/healthz" not in asks, asks
    assert head["readinessProbe"]["periodSeconds"] * head["readinessProbe"]["failureThreshold"] <= 60


def test_a_workers_readiness_asks_its_proxy_and_the_application_on_the_serve_port(manifest):
    port = _serve_port(manifest)
    # Proxies on every node: a worker's readiness asks its own, which HeadOnly never starts.
    assert yaml.safe_load(manifest["spec"]["serveConfigV2"])["proxy_location"] == "EveryNode"
    workers = [(g, s, c) for g, s, c in _containers(manifest) if g != "head"]
    assert workers
    for group, start, container in workers:
        readiness = container["readinessProbe"]
        asks = _asks(readiness)
        agent = int(start.get("dashboard-agent-listen-port", AGENT_PORT))
        for url in (f"http://localhost:{agent}/api/healthz", f"http://localhost:{port}/-/healthz",
                    f"http://localhost:{port}/health"):
            assert url in asks, f"{group}: readiness does not ask {url}: {asks}"
        assert {"containerPort": port, "name": "serve"} in container["ports"], group
        # Out of the serve Service within one period of a failure; never a restart (readiness only).
        assert readiness["failureThreshold"] == 1 and readiness["periodSeconds"] <= 10, group
        assert readiness["timeoutSeconds"] >= 8, f"{group}: the three requests take up to 8 s"
