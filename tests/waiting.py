"""Polling for a condition in tests that drive real processes (Ray actors, Serve replicas)."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float = 30.0, what: str = "condition", poll_s: float = 0.2,
             explain: Callable[[], str] | None = None) -> T:
    """The first truthy value ``predicate()`` returns within ``timeout_s``; else an AssertionError
    naming ``what`` (and ``explain()``: the state it was left in)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}" + (f": {explain()}" if explain else ""))


def run_app(app, name: str, timeout_s: float = 240.0, route_prefix: str | None = None):
    """``serve.run`` with a deadline: the app's ingress handle once every deployment is RUNNING, or an
    AssertionError naming the app's and each deployment's status and message and any dead node.

    serve.run waits without end: when a fake node's raylet had exited at start (seen once in a clean-clone
    run), the replica meant for it was never placed and the suite hung to CI's limit instead of failing."""
    from ray import serve

    (handle,) = serve.run_many([serve.RunTarget(app, name=name, route_prefix=route_prefix)],
                               wait_for_applications_running=False)

    def running() -> bool:
        status = serve.status().applications[name]
        if status.status == "DEPLOY_FAILED":
            raise AssertionError(f"app {name!r} failed to deploy: {_describe(status)}")
        return status.status == "RUNNING"

    wait_for(running, timeout_s, f"app {name!r} to be RUNNING", 0.5,
             explain=lambda: _describe(serve.status().applications[name]))
    return handle


def _describe(status) -> str:
    import ray

    deployments = "; ".join(f"{d}: {s.status.value} {s.message!r}" for d, s in status.deployments.items())
    dead = [n["NodeManagerAddress"] + " " + str(n["Resources"]) for n in ray.nodes() if not n["Alive"]]
    return f"{status.status.value} {status.message!r}; {deployments}; dead nodes: {dead or 'none'}"
