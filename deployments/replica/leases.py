"""A stage replica's leases, opened in one place: its view of the node ledger (host budget, GPU pool) and its device leases.
Run in the stage replica's process.

``cluster.replica.ledger_view.ReplicaMemory`` leases from the node's one ledger actor (and falls back
to an in-process ledger itself when Ray is not running). :func:`open_replica_memory` is the only
place the service opens it; :func:`open_device_leases` caps the process at its share of the GPU
and gives the device leases torch's ``empty_cache`` to return bytes to the driver; it also gives
the replica's device its neighbours' outstanding leases, so headroom leaves them alone.
"""
from __future__ import annotations

import logging
import time

import torch

from cluster.replica import device_leases, ledger_view
from offload_core.streaming.device import get_device
from offload_core.streaming.headroom import SMALL_REQUEST

logger = logging.getLogger(__name__)


def open_replica_memory(owner: str, device: torch.device) -> ledger_view.ReplicaMemory:
    """The node's shared host budget (``.host_budget``) and the device pool for one replica."""
    return ledger_view.ReplicaMemory.open(owner, device)



def open_device_leases(memory: ledger_view.ReplicaMemory, device: torch.device) -> device_leases.DeviceLeases:
    """The replica's device leases; on CUDA the process is first capped at its share of the GPU.

    The cap makes an allocation beyond the share fail in this process (an OOM error it can report)
    instead of taking bytes a neighbour leased.
    """
    fraction = memory.process_memory_fraction()
    if device.type == "cuda" and fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        logger.info("%s: process capped at %.3f of %s (%.2f GB, its share)", memory.owner, fraction, device,
                    memory.share_bytes / 1e9)
    to_driver = torch.cuda.empty_cache if device.type == "cuda" else None
    engine_device = get_device(device)
    neighbours = memory.neighbour_leases()
    if neighbours is not None:
        engine_device.set_neighbours(neighbours)
    # Reported with a large-pool request's size: the largest cached block is then the large pool's.
    return memory.device_leases(to_driver=to_driver, headroom=lambda: engine_device.headroom(SMALL_REQUEST + 1))


LEASE_REFUSED = device_leases.LeaseRefused


class NeverPlaceable(RuntimeError):
    """A starting replica's standing lease is larger than its whole GPU pool: no wait can grant it."""


def hold_standing_at_start(leases: device_leases.DeviceLeases, nbytes: int, attempt_s: float, capacity: int,
                           owner: str, clock=time.monotonic) -> int:
    """Take the standing lease a starting replica's plan keeps, asking again after each refusal.

    A refusal at start means the neighbours on its GPU hold the bytes now (their calls: the load that
    scaled the stage out). Failing the start would have Serve start the replica again into the same
    load, a crash loop; waiting keeps it STARTING, and ``GET /v1/residency`` lists it under pending
    (:func:`deployments.capacity.unplaced.pending_replicas`) until the ledger grants it. Only a lease
    larger than the whole pool, which no wait can grant, fails the start. Returns the refusals waited through.
    """
    if nbytes > capacity:
        raise NeverPlaceable(f"{owner}: its plan keeps {nbytes} B on the device, more than the {capacity} B its "
                             "node ledger's GPU pool holds in all")
    started, refusals = clock(), 0
    while True:
        try:
            leases.hold_standing(nbytes, attempt_s)
        except LEASE_REFUSED as exc:
            refusals += 1
            logger.info("%s: start waits for its node ledger: standing lease of %d B refused (%s); %.1f s waited, "
                        "%d refusals; asking again", owner, nbytes, exc.refusal.reason, clock() - started, refusals)
            continue
        if refusals:
            logger.info("%s: standing lease of %d B granted after %.1f s and %d refusals", owner, nbytes,
                        clock() - started, refusals)
        return refusals
