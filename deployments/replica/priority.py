"""The niceness a stage replica's worker process runs at, and its tensor-parallel ranks'.

Ray starts every worker process at niceness 15 (its ``RAY_worker_niceness``, read by the worker
from its environment as it starts: an actor whose runtime_env sets it to 0 ran at 0 under Ray 2.60,
one without it at 15). Used by ``deployments.app`` (build time, the driver) for the stage
deployments' ray_actor_options, and by a replica (its process) for the rank actors it starts, so
the ranks run at the replica's own niceness.
"""
from __future__ import annotations

import logging
import os
from typing import Mapping

logger = logging.getLogger(__name__)

RAY_NICENESS_ENV = "RAY_worker_niceness"


def stage_actor_options(actor: Mapping, niceness: int | None) -> dict:
    """A stage replica's ray_actor_options: ``actor`` with the niceness Ray starts its worker at
    (``AppArgs.replica_niceness``; None: Ray's). A config file's ray_actor_options replace these whole."""
    if niceness is None:
        return dict(actor)
    return {**actor, "runtime_env": {"env_vars": {RAY_NICENESS_ENV: str(niceness)}}}


def rank_env() -> dict[str, str]:
    """Environment for a rank actor: this process's niceness (Ray would start the rank at its 15)."""
    return {RAY_NICENESS_ENV: str(os.nice(0))}


def check_niceness(asked: int | None, replica: str) -> int:
    """This process's niceness; said at INFO when it is not the one ``asked`` for (and why it would not be)."""
    got = os.nice(0)
    if asked is not None and got != asked:
        logger.info("%s: runs at nice %d, not the replica_niceness %d asked for: Ray did not start it with it "
                    "(a Serve config file's ray_actor_options for a deployment replace the app's, runtime_env included); "
                    "set env_vars %s: \"%d\" in the application's runtime_env (configs/gpu.yaml does)",
                    replica, got, asked, RAY_NICENESS_ENV, asked)
    return got
