"""The Kubernetes probes of the Ray containers in every RayService that k8s/render.py renders.

KubeRay injects its own probes into a Ray container that has none (raylet and GCS health on the
head; raylet health and, for a RayService, the Serve proxy's ``/-/healthz`` on the workers) and
leaves a container's own probes alone. Ours differ from its defaults in three ways:

* a **startupProbe** on every container, so liveness only starts once ``ray start`` has joined the
  cluster (KubeRay's defaults rely on an initial delay of 30 s);
* **worker readiness also asks the application**: ``GET /health`` through the node's Serve proxy
  is 200 only while every stage deployment has a running replica (a 503 names the stage). Loading
  tens of GB of weights is a readiness wait: the pod stays out of the serve Service, never killed;
* **liveness asks Ray's node health only** (``/api/healthz`` of the node's dashboard agent: raylet,
  and GCS on the head), never the application or the proxy, with ten minutes of tolerance, so a
  replica loading or pinning tens of GB (the node busy, the agent slow to answer) is never
  restarted for it.

The head's readiness must not wait for the application: KubeRay submits serveConfigV2 only once
the head pod is ready, so a head readiness on ``/health`` would never let the application deploy.
Whether the head's proxy takes traffic is KubeRay's own check (it sets the head's serve label at
every reconcile). Health endpoints answer without Ray's token (Ray keeps them public) and
``/health`` without the API's bearer token (deployments/api/guard.py OPEN_PATHS).
"""
from __future__ import annotations

from dataclasses import dataclass

# Ray's dashboard agent port (rayStartParams dashboard-agent-listen-port, set to this explicitly so
# the probes and Ray cannot disagree). Its /api/healthz (Ray >= 2.53) is the raylet's health, and
# the GCS's too on the head: KubeRay's own HTTP probe for such Ray versions.
AGENT_PORT = 52365
NODE_HEALTH = "/api/healthz"
SERVE_PORT = 8000  # serveConfigV2 http_options.port: the Serve proxy on every node (proxy_location EveryNode)
PROXY_HEALTH = "/-/healthz"  # the node's Serve proxy: 200 once it has its routes, 503 while draining
APP_HEALTH = "/health"  # the application: 200 while every stage deployment has a running replica


@dataclass(frozen=True)
class Timing:
    """When a probe runs and how many failures in a row it takes to act."""

    period_s: int
    timeout_s: int
    failure_threshold: int

    @property
    def tolerance_s(self) -> int:
        """How long a probe may fail in a row before Kubernetes acts (restart, or out of service)."""
        return self.period_s * self.failure_threshold

    def fields(self) -> dict:
        return {"periodSeconds": self.period_s, "timeoutSeconds": self.timeout_s,
                "successThreshold": 1, "failureThreshold": self.failure_threshold}


# `ray start` on a worker waits for the head's GCS (Ray's reconnect timeout on KubeRay is 600 s);
# liveness starts only once this passes, so a slow join is never a restart loop.
STARTUP = Timing(period_s=10, timeout_s=5, failure_threshold=60)
# KubeRay's default tolerance (5 s x 120 = 10 min): a node copying tens of GB into pinned memory
# may answer slowly; a raylet that is really gone is restarted after ten minutes.
LIVENESS = Timing(period_s=10, timeout_s=5, failure_threshold=60)
# The head: as KubeRay's default (5 s, 10 failures); it gates nothing but KubeRay's own deploy.
HEAD_READINESS = Timing(period_s=5, timeout_s=5, failure_threshold=10)
# Workers: out of the serve Service at the first failure, as KubeRay's Serve default (threshold 1),
# so a draining proxy or a stage that went down stops taking traffic within one period. The
# timeout covers the three requests of the command (2 + 2 + 4 s of wget timeouts).
WORKER_READINESS = Timing(period_s=5, timeout_s=10, failure_threshold=1)


def _node_health() -> dict:
    # A new dict per probe: shared ones would be dumped as YAML anchors and aliases.
    return {"httpGet": {"path": NODE_HEALTH, "port": AGENT_PORT}}


def _wget(url: str, timeout_s: int) -> str:
    # --tries 1: a probe that retries inside itself outlives its own timeoutSeconds. wget exits
    # non-zero on any HTTP error status (a 503 from /health included).
    return f"wget --tries 1 -T {timeout_s} -q -O /dev/null {url}"


def worker_readiness_command() -> list[str]:
    """Raylet, then the node's Serve proxy, then the application through that proxy (KubeRay's
    Serve default is the first two, with wget in the Ray image as here)."""
    checks = [_wget(f"http://localhost:{AGENT_PORT}{NODE_HEALTH}", 2),
              _wget(f"http://localhost:{SERVE_PORT}{PROXY_HEALTH}", 2),
              _wget(f"http://localhost:{SERVE_PORT}{APP_HEALTH}", 4)]
    return ["bash", "-c", " && ".join(checks)]


def head_probes() -> dict:
    """Startup, liveness and readiness of the head: Ray's node health (raylet and GCS) only."""
    return {"startupProbe": _node_health() | STARTUP.fields(), "livenessProbe": _node_health() | LIVENESS.fields(),
            "readinessProbe": _node_health() | HEAD_READINESS.fields()}


def worker_probes() -> dict:
    """Startup and liveness on the raylet's health; readiness on the proxy and the application."""
    return {"startupProbe": _node_health() | STARTUP.fields(), "livenessProbe": _node_health() | LIVENESS.fields(),
            "readinessProbe": {"exec": {"command": worker_readiness_command()}} | WORKER_READINESS.fields()}
