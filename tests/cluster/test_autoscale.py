"""Under load the denoiser scales 1 -> 2 -> 1 on work (the app's WorkPolicy, run by Serve's controller),
its second replica leasing from the same node ledger."""
from __future__ import annotations

import itertools
import threading
import time

import ray
from ray import serve

from cluster.ledger.actor import HOST_POOL, node_ledger
from cluster.replica.ledger_view import ReplicaMemory
from deployments.capacity.work_autoscaling import POLICY_PATH, REQUEST_S, REQUESTS, WORK_S
from tests.cluster.conftest import FAST
from tests.conftest import free_port
from tests.waiting import run_app, wait_for

GB = 10**9
APP = "cluster-autoscale-test"


# A replica being stopped (the scale-down, the delete) checks for requests left every 0.2 s, not
# Serve's 2 s (each stop took 2.1 s); scale-down 0.5 s after the load is gone, not 2 s (during the load
# the desired count is 4, capped at 2, so no earlier scale-down can come of it). Scaled on work: 1 s of
# work per replica; 4 clients of 1-s requests hold ~4 s. Serve's own rule (the policy's fallback when
# no stats are fresh) would want 4 ongoing / 100 per replica: one replica, so a second one shows the
# work policy ran in the controller on the replicas' stats.
@serve.deployment(
    max_ongoing_requests=1,
    ray_actor_options={"num_cpus": 0, "num_gpus": 0.25, "accelerator_type": "L4"},
    autoscaling_config={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 100,
                        "metrics_interval_s": 0.2, "look_back_period_s": 1.0,
                        "upscale_delay_s": 0.2, "downscale_delay_s": 0.5,
                        "policy": {"policy_function": POLICY_PATH, "policy_kwargs": {"target_work_s": 1.0}}},
    graceful_shutdown_wait_loop_s=0.2,
)
class Denoiser:
    """A stand-in denoiser: pins its 'weights' on the host, leases its working set per call."""

    def __init__(self):
        replica = serve.get_replica_context().replica_id.unique_id
        self.memory = ReplicaMemory.open(f"denoiser#{replica}", "cpu", config=FAST)
        self.leases = self.memory.device_leases(idle_s=0.2)  # as a stage worker's, kept between calls
        self.weights = self.memory.host_budget.request(GB, self.memory.owner, 50.0, "pinned:transformer")
        assert self.weights, f"the test node has room for two replicas' pins: {self.weights}"
        self.ends: dict[int, float] = {}  # request -> when it will be done (a stand-in's queue)
        self.calls = itertools.count()

    def __call__(self, hold_s: float) -> str:
        call = next(self.calls)
        self.ends[call] = time.monotonic() + hold_s
        try:
            with self.leases.call(2 * GB, timeout_s=30):
                time.sleep(hold_s)
        finally:
            self.ends.pop(call, None)
        return self.memory.owner

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What a Denoiser reports (deployments.capacity.work_autoscaling.autoscaling_stats): its work."""
        now = time.monotonic()
        return {WORK_S: sum(max(0.0, end - now) for end in self.ends.values()), REQUESTS: float(len(self.ends)),
                REQUEST_S: 1.0}

    def __del__(self):
        self.memory.close()


def _denoiser_owners(node_id) -> set[str]:
    leases = ray.get(node_ledger(node_id).outstanding.remote(HOST_POOL), timeout=60)
    return {l.owner for l in leases if l.owner.startswith("denoiser#")}


def _running_replicas() -> int:
    status = serve.status().applications[APP].deployments["Denoiser"]
    return status.replica_states.get("RUNNING", 0)


def test_the_denoiser_scales_out_and_back_leasing_from_one_node_ledger(fleet_nodes):
    # Serve's first start sets its proxies for the session: one, on the head (tests/deployments/conftest.py).
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": free_port()})
    handle = run_app(Denoiser.bind(), APP)
    l4 = fleet_nodes.l4.node_id
    try:
        assert handle.remote(0.0).result(timeout_s=60).startswith("denoiser#")
        assert len(_denoiser_owners(l4)) == 1
        stop = threading.Event()

        def client():  # 4 clients, 1 s per request: twice the target of 1 ongoing per replica
            while not stop.is_set():
                handle.remote(1.0).result(timeout_s=60)

        clients = [threading.Thread(target=client, daemon=True) for _ in range(4)]
        for c in clients:
            c.start()
        try:
            wait_for(lambda: _running_replicas() == 2 and len(_denoiser_owners(l4)) == 2, 90,
                      "a second replica leasing from the L4 node's ledger")
        finally:
            stop.set()
            for c in clients:
                c.join(60)
        state = ray.get(node_ledger(l4).state.remote())
        assert state.pool("gpu:0").peak_leased <= state.pool("gpu:0").capacity
        wait_for(lambda: _running_replicas() == 1, 90, "scale back to one replica")
        wait_for(lambda: len(_denoiser_owners(l4)) == 1, 30, "the removed replica's pins to be returned")
    finally:
        serve.delete(APP)
    wait_for(lambda: not _denoiser_owners(l4), 30, "every replica's pins to be returned")
