"""A tensor-parallel stage replica's ranks: N worker actors in the replica's own placement group.

Runs in two kinds of process: the stage replica (:class:`ShardGroup`, the fan-out) and each of its
N rank actors (:class:`RankWorker`, one :class:`~deployments.replica.worker.StageWorker` each).

- Placement: Serve gives the replica ``tp_size`` bundles (one GPU each on a GPU node, strict
  pack); rank i is scheduled into bundle i of the replica's *current* placement group, as Ray
  Serve LLM and vLLM's Ray executor do. On GPUs the ranks' UUIDs must be distinct before anything
  loads (two ranks on one GPU would each plan against the whole card).
- Rendezvous: rank 0 picks a free TCP port on its node for every replica, so replicas never share
  a process group. NCCL on CUDA, gloo on CPU, with a short collective timeout (a dead NCCL peer
  otherwise hangs until the 10-minute watchdog) and ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``.
- Calls: collectives need every rank to run the same calls in the same order, and Ray orders
  calls only per caller; so one lock serialises the fan-out, every call goes to all ranks, and
  rank 0's output is the answer. ``max_task_retries=0``: a retried call would run on one rank only.
- Faults: a rank that dies or stays inside a call past the timeout breaks the group for good:
  the call in flight fails with :class:`RankLost` (a 503), the health check fails from then on,
  and Serve replaces the replica (fresh group, fresh leases; the ledger reclaims the dead rank's).
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from typing import Callable

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.replica.board import RANK_ACTOR_PREFIX
from deployments.replica.logs import into_replica_log
from deployments.replica.priority import rank_env
from deployments.replica.rank_spec import RankIdentity, RankSpec
from deployments.replica.worker import StageWorker
from deployments.wire.spec import RankLost, RequestRejected

logger = logging.getLogger(__name__)

# A collective that waits longer than this fails: a hung rank is then a fault, not a hang. 60 s is
# 600x the tiny encoder's call here and 10x a 512-token umT5-XXL encode on an L4.
COLLECTIVE_TIMEOUT_S = 60.0
# Loading N slices (and the warm-up) may take minutes at real size; past this the replica fails to start.
START_TIMEOUT_S = 900.0
# The health check's wait for every rank's answer (they answer on a second thread, beside a call).
PING_TIMEOUT_S = 10.0
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def _gpu_uuid() -> str | None:
    if not (torch.cuda.is_available() and ray.get_gpu_ids()):
        return None
    return str(torch.cuda.get_device_properties(0).uuid)


@ray.remote(max_restarts=0, max_task_retries=0)
class RankWorker:
    """One rank: joins the replica's process group, loads its slice, runs each call it is sent."""

    def __init__(self, spec: RankSpec):
        into_replica_log()
        self.spec = spec
        self.worker = None

    def identity(self) -> RankIdentity:
        return RankIdentity(self.spec.rank, ray.util.get_node_ip_address(), os.getpid(), _gpu_uuid())

    def free_port(self) -> int:
        """A free TCP port on this node for the group's rendezvous (rank 0 only)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, config, master: str, port: int, timeout_s: float) -> None:
        backend = "nccl" if _gpu_uuid() is not None else "gloo"
        # Ray shows each rank only its own GPU: it is cuda:0 here, whatever its index on the node.
        os.environ.update(LOCAL_RANK="0", RANK=str(self.spec.rank), WORLD_SIZE=str(self.spec.size), **NCCL_ENV)
        torch.distributed.init_process_group(backend, init_method=f"tcp://{master}:{port}", rank=self.spec.rank,
                                             world_size=self.spec.size,
                                             timeout=datetime.timedelta(seconds=timeout_s))
        logger.info("%s: joined a %s group of %d at %s:%d (collective timeout %.0f s)", self.spec.worker_id,
                    backend, self.spec.size, master, port, timeout_s)
        self.worker = StageWorker(config, rank=self.spec)

    def call(self, fn: Callable, *args):
        """``fn(stage_worker, *args)``; rank 0 returns its result, the others only run it (their output is rank 0's)."""
        result = fn(self.worker, *args)
        return result if self.spec.rank == 0 else None

    def report(self):
        return self.worker.report()

    def ping(self) -> int:
        return self.spec.rank

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class ShardGroup:
    """The replica's N rank actors: started in its placement group, called in one order, closed with it."""

    def __init__(self, config, replica: str, size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S):
        self.replica, self.size, self.timeout_s = replica, size, timeout_s
        self.broken: str | None = None
        self._lock = threading.Lock()
        group = get_current_placement_group()
        if group is None or len(group.bundle_specs) < size:
            raise RuntimeError(f"{replica}: tp_size {size} needs the replica's placement group of {size} bundles "
                               f"(got {None if group is None else len(group.bundle_specs)})")
        self.ranks = [self._rank_actor(group, RankSpec(i, size, replica)) for i in range(size)]
        try:
            self.identities = ray.get([r.identity.remote() for r in self.ranks], timeout=START_TIMEOUT_S)
            check_distinct_gpus(self.identities)
            port = ray.get(self.ranks[0].free_port.remote(), timeout=START_TIMEOUT_S)
            master = self.identities[0].node_ip
            ray.get([r.start.remote(config, master, port, timeout_s) for r in self.ranks], timeout=START_TIMEOUT_S)
        except BaseException:
            self._kill()
            raise
        logger.info("%s: %d ranks ready on %s (pids %s, GPUs %s)", replica, size, master,
                    [i.pid for i in self.identities], [i.gpu_uuid for i in self.identities])

    @staticmethod
    def _rank_actor(group, spec: RankSpec):
        bundle = group.bundle_specs[spec.rank]
        return RankWorker.options(
            name=RANK_ACTOR_PREFIX + spec.worker_id, namespace="serve", lifetime=None,
            num_cpus=0, num_gpus=1 if bundle.get("GPU", 0) >= 1 else 0,
            # Two threads: the health check's ping answers beside a call in flight.
            max_concurrency=2,
            runtime_env={"env_vars": {**NCCL_ENV, **rank_env()}},  # at the replica's niceness
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=spec.rank),
        ).remote(spec)

    def call(self, fn: Callable, *args):
        """``fn(worker, *args)`` on every rank, in one order across calls; rank 0's result.

        A rank that died, or did not finish within the collective timeout (plus a margin for the
        call's own work), breaks the group: :class:`RankLost`.
        """
        with self._lock:
            if self.broken is not None:
                raise RankLost(f"{self.replica}: {self.broken}; the replica is being replaced")
            start = time.monotonic()
            refs = [r.call.remote(fn, *args) for r in self.ranks]
            try:
                results = ray.get(refs, timeout=2 * self.timeout_s)
            except RayTaskError as exc:
                if not _is_rank_fault(exc):
                    self._settle(refs)  # a request-caused error (the same on every rank): the group stays
                    raise
                self._break(f"a rank failed inside a collective ({type(exc.cause).__name__}: {exc.cause})", start)
                raise RankLost(f"{self.replica}: {self.broken}") from exc
            except (RayActorError, GetTimeoutError) as exc:
                why = "a rank died" if isinstance(exc, RayActorError) else "a rank hung past the timeout"
                self._break(f"{why} ({type(exc).__name__})", start)
                raise RankLost(f"{self.replica}: {self.broken}") from exc
            return results[0]

    def _settle(self, refs) -> None:
        """Wait for every rank's end of a call that failed on one (they all fail alike or finish)."""
        ray.wait(refs, num_returns=len(refs), timeout=2 * self.timeout_s)

    def _break(self, why: str, start: float) -> None:
        self.broken = why
        logger.error("%s: tensor-parallel group broken after %.2f s of the call: %s; the health check fails "
                     "from now on and Serve replaces the replica", self.replica, time.monotonic() - start, why)
        self._kill()

    def check_health(self) -> None:
        """Raise unless every rank answers (Serve's health check: a failure replaces the replica)."""
        if self.broken is not None:
            raise RankLost(f"{self.replica}: {self.broken}")
        try:
            ray.get([r.ping.remote() for r in self.ranks], timeout=PING_TIMEOUT_S)
        except (RayActorError, GetTimeoutError) as exc:
            self._break(f"a rank did not answer the health check ({type(exc).__name__})", time.monotonic())
            raise RankLost(f"{self.replica}: {self.broken}") from exc

    def reports(self) -> list:
        """Each rank's residency report, rank order."""
        return ray.get([r.report.remote() for r in self.ranks], timeout=PING_TIMEOUT_S)

    def close(self) -> None:
        """Replica shutdown: every rank gives back its leases and leaves the group, then the actors go."""
        if not self.broken:
            try:
                ray.get([r.close.remote() for r in self.ranks], timeout=PING_TIMEOUT_S)
            except (RayActorError, GetTimeoutError, RayTaskError) as exc:
                logger.warning("%s: a rank did not close cleanly (%s); killing the ranks", self.replica, exc)
        self._kill()

    def _kill(self) -> None:
        for r in self.ranks:
            ray.kill(r, no_restart=True)


def _is_rank_fault(exc: RayTaskError) -> bool:
    """Anything but a request-caused refusal: a collective whose peer is gone (gloo raises in ~0.1 s),
    a rank's lease refused while the others wait in a collective, a fault. Each breaks the group."""
    return not isinstance(exc.cause, RequestRejected)


def check_distinct_gpus(identities: list[RankIdentity]) -> None:
    """Ranks of one replica must hold distinct GPUs (each plans against its whole share of one card)."""
    uuids = [i.gpu_uuid for i in identities if i.gpu_uuid is not None]
    if len(set(uuids)) != len(uuids):
        raise RuntimeError(f"tensor-parallel ranks share a GPU: UUIDs {uuids}; each rank needs its own GPU "
                           "(one bundle with GPU: 1 per rank)")

