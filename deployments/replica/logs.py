"""Where the project's decision lines go in a Serve replica's process (and a rank actor's).

Every module logs its decisions at INFO under its own name (``offload_core.planner.search``,
``deployments.routing.router``, ...). Serve configures only its own ``ray.serve`` logger in a replica
(a file handler into ``logs/serve/replica_<app>_<deployment>_<id>.log``, with the request id); the
project's loggers inherit the root logger's WARNING, so without this not one plan, lease or routing
line reached any log under Serve (CI's session logs at 9c6cdb9 held none). :func:`into_replica_log`
gives the project's top-level loggers Serve's handlers and level, so the lines land in the replica's
own log beside Serve's, formatted as Serve formats its own. In a plain Ray actor (a rank actor)
the loggers only get INFO and reach the actor's stderr log through the root logger, as the node
ledger's lines do. Anywhere else (a test constructing a deployment's class in its own process) it
changes nothing: pytest's log capture keeps working.

Called first thing in each deployment's constructor (the three stages and the ingress, whose
process also runs the Denoiser's request router) and in each tensor-parallel rank actor.
"""
from __future__ import annotations

import logging

PROJECT_LOGGERS = ("offload_core", "cluster", "deployments", "compat")
SERVE_LOGGER = "ray.serve"  # Serve's documented logger for a replica's own lines


def into_replica_log() -> None:
    """Send the project's INFO lines to this replica's Serve log (idempotent; see the module docstring)."""
    place = _where()
    if place is None:
        return
    serve = logging.getLogger(SERVE_LOGGER)
    in_replica = place == "replica" and bool(serve.handlers)
    level = serve.level if in_replica and serve.level != logging.NOTSET else logging.INFO
    for name in PROJECT_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not in_replica:
            continue
        for handler in serve.handlers:
            if handler not in logger.handlers:
                logger.addHandler(handler)
        logger.propagate = False  # once, in Serve's file: not again through the root's stderr


def _where() -> str | None:
    """"replica" in a Serve replica, "actor" in another Ray actor, None in any other process."""
    import ray
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        serve.get_replica_context()
    except RayServeException:  # not a replica: maybe another actor
        in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
        return "actor" if in_actor else None
    return "replica"
